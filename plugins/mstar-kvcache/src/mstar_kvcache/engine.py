"""`KVCacheEngine` (kind `kvcache`): continuous batching of transformer calls over a paged KV pool."""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any

import torch

from mstar_core.errors import RequestError
from mstar_core.graph.options import check_call_options, declare_call_options
from mstar_core.runtime.engine import Engine, EngineContext, Invocation, Result
from mstar_kvcache.batch import build_batch, rope_positions
from mstar_kvcache.blocks import BlockManager
from mstar_kvcache.config import KVCacheSettings, kv_shape, select_backend
from mstar_kvcache.contract import BUILTIN_OUTPUTS, KVCacheModule, call_inputs, check_kvcache_module, samples
from mstar_kvcache.inputs import OPTIONS, ParsedInvocation, mask_limits, parse_invocation
from mstar_kvcache.pool import PagePool
from mstar_kvcache.sampler import Sampled, sample
from mstar_kvcache.scheduler import Scheduler
from mstar_kvcache.sequence import Sequence
from mstar_kvcache.sharing import cache_owner
from mstar_kvcache.transfer import CacheTransfer

declare_call_options("kvcache", OPTIONS, node_refs=("share_cache_with",))


class KVCacheEngine(CacheTransfer, Engine):
    """Runs a transformer node's calls over paged KV, many requests and cache labels per forward.

    What a call takes and returns is in `inputs.py` (inputs and options) and `contract.py` (what
    the module provides). A node that declares `next_token` samples: outputs `next_token`,
    `finish_reason`, and when declared `logprob` / `top_logprobs` (as the sampling params ask),
    `logits` and `hidden` of the last row. Any other node returns per-token rows with no vocabulary
    projection: `hidden` and each `compute_<name>` output, for every row of the call
    (`output_rows: "all"`), the last one, or the rows at input `output_index`.

    A call appends its tokens to its cache label and attends to everything before them; with
    `write_cache: False` it is read-only: it attends to the frozen `read_labels` (default its
    `cache_label`) plus its own tokens, which are never stored, and takes no page. Larger
    `Invocation.priority` is scheduled first.
    """

    kind = "kvcache"
    moves_state = True
    module_contract = KVCacheModule
    call_options = frozenset(OPTIONS)

    def __init__(self, node: Any, module: Any, context: EngineContext):
        super().__init__(node, module, context)
        check_kvcache_module(module, node)  # at load: a module missing a method fails here, not on a request
        # graphs built before this plugin was imported were not checked by Graph.build: check their calls now
        check_call_options(node.name, self.kind, getattr(node, "call_sites", ()), OPTIONS, node.options)
        self.settings = KVCacheSettings.from_mapping(context.settings)
        self.device = torch.device(context.device)
        layers, kv_heads, head_dim, self.vocab_size, self.hidden_size = kv_shape(module)
        first = next(iter(module.parameters()), None) if hasattr(module, "parameters") else None
        self.dtype = dtype = torch.float32 if first is None else first.dtype
        self.samples = samples(node)
        self.axes = int(getattr(module, "position_axes", 1) or 1)
        self.call_inputs = {k: v for k, v in call_inputs(module, node.name).items() if k in node.all_inputs}
        self.routed = "routing" in node.all_inputs
        self.extra_outputs = [o for o in node.outputs if o not in BUILTIN_OUTPUTS]
        self.share_with = node.options.get("share_cache_with")
        self.kv_shape = (layers, kv_heads, head_dim, dtype)
        # a reader of another node's labels uses that node's pool (see sharing.py); every other node owns its own
        self.partner = None if self.share_with is None else cache_owner(self, self.share_with, self.kv_shape)
        if self.partner is not None:
            self.pool = self.partner.pool
        else:
            pages = self.settings.resolve_num_pages(layers, kv_heads, head_dim, dtype)
            self.pool = PagePool(pages, self.settings.page_size, layers, kv_heads, head_dim, dtype, self.device)
        self.blocks = BlockManager(self.pool, self.settings.enable_prefix_caching, salt=node.name)
        self.scheduler = Scheduler(self.blocks, self.settings.max_num_seqs, self.settings.max_num_batched_tokens)
        self.backend = select_backend(self.settings.attention_backend, self.device, context.registry)
        self.forward_fn = module if not self.settings.compile else self._compiled(module)
        self.max_model_len = getattr(getattr(module, "config", None), "max_position_embeddings", None)
        self.seqs: dict[tuple[str, str], Sequence] = {}
        self.backlog: deque[Invocation] = deque()  # calls for a label that already has one in flight
        self.answered: list[Result] = []  # answered without a forward pass: rejections and state transfers
        self.waiting_readers: list[tuple[Invocation, ParsedInvocation]] = []  # read-only calls not attached yet
        self.readers: list[Sequence] = []  # attached read-only calls (they hold references to their pages)
        self._order = itertools.count()
        self.num_preemptions = 0
        self.num_steps = 0
        self.largest_batch = 0  # most sequences (calls, labels) one forward has run so far

    @property
    def max_batch_size(self) -> int:
        return int(self.context.settings.get("max_batch_size", 4 * self.settings.max_num_seqs))

    def _compiled(self, module: Any) -> Any:
        from mstar_kvcache.compiled import CompiledForward, default_buckets

        buckets = self.settings.compile_buckets or default_buckets(self.settings.max_num_batched_tokens)
        return CompiledForward(module, self.device, buckets, cuda_graphs=self.settings.cuda_graphs, node=self.node.name)

    # -- contract ---------------------------------------------------------------------------------

    def add(self, invocation: Invocation) -> None:
        transfer = invocation.options.get("transfer")
        if transfer is not None:
            answer = self._transfer(invocation, transfer)  # (an export releases, which rebuilds `answered`)
            self.answered.append((invocation, answer))
            return
        # whatever this invocation's inputs trigger here (parsing, seeding, attaching) answers it alone
        try:
            parsed = self._parse(invocation)
            if not parsed.write_cache:
                self.waiting_readers.append((invocation, parsed))
                return
            seq = self._sequence(invocation, parsed)
        except Exception as exc:
            self.answered.append((invocation, exc))
            return
        if seq.pending is not None:
            self.backlog.append(invocation)
            return
        try:
            self._attach(seq, invocation, parsed)
        except Exception as exc:
            self.answered.append((invocation, exc))

    def has_work(self) -> bool:
        return (bool(self.answered) or bool(self.waiting_readers) or bool(self.readers)
                or any(s.pending is not None or s.recompute for s in self.seqs.values()))

    def step(self) -> list[Result]:
        if self.waiting_readers:
            self._attach_readers()
        results, self.answered = self.answered, []
        pending = [s for s in self.seqs.values() if s.pending is not None or s.recompute]
        pending.extend(self.readers)
        if not pending:
            return results
        plan = self.scheduler.schedule(pending, self.seqs.values)
        self.num_preemptions += len(plan.preempted)
        for seq in plan.preempted:  # recomputed from its first token: its call's rows are gathered again
            seq.collected = []
        for seq in plan.too_large:
            need = self.blocks.total_pages(seq)
            results.append(self._fail(seq, RequestError(
                f"node '{self.node.name}': sequence needs {need} KV pages but the pool has {self.pool.num_pages}; "
                "raise the node's num_pages (or kv_cache_bytes) setting or send a shorter input", status=413)))
        if not plan.work:
            return results
        self.num_steps += 1
        self.largest_batch = max(self.largest_batch, len(plan.work))
        results.extend(self._run(plan.work))
        return results

    def release(self, request_id: str) -> None:
        forget = getattr(self.backend, "forget", None)  # backends may keep per-sequence state (decode lanes)
        for key in [k for k in self.seqs if k[0] == request_id]:
            seq = self.seqs.pop(key)
            self.blocks.free(seq)
            if forget is not None:
                forget(seq.order)
        for reader in [r for r in self.readers if r.request_id == request_id]:
            self._drop_reader(reader)
        self.waiting_readers = [w for w in self.waiting_readers if w[0].request_id != request_id]
        self.backlog = deque(inv for inv in self.backlog if inv.request_id != request_id)
        self.answered = [r for r in self.answered if r[0].request_id != request_id]

    def active_requests(self) -> set[str]:
        return ({k[0] for k in self.seqs} | {i.request_id for i in self.backlog} | {r[0].request_id for r in self.answered}
                | {r.request_id for r in self.readers} | {w[0].request_id for w in self.waiting_readers})

    def stats(self) -> dict[str, float]:
        pending = [s for s in self.seqs.values() if s.pending is not None]
        return {
            "kv_pages_total": self.pool.num_pages,
            "kv_pages_used": self.pool.num_used,
            "kv_pages_cached": self.pool.num_cached,
            "kv_page_copies": self.pool.copies,
            "kv_prefix_hit_pages": self.pool.hits,
            "num_preemptions": self.num_preemptions,
            "largest_batch": self.largest_batch,
            "num_running": sum(1 for s in pending if s.pages) + len(self.readers),
            "num_waiting": sum(1 for s in pending if not s.pages) + len(self.waiting_readers),
            **({"compile_seconds": self.forward_fn.compile_seconds} if self.forward_fn is not self.module else {}),
        }

    def close(self) -> None:
        for seq in self.seqs.values():
            self.blocks.free(seq)
        for reader in list(self.readers):
            self._drop_reader(reader)
        self.seqs.clear()

    def fork(self, request_id: str, src_label: str, dst_label: str) -> None:
        """Share `src_label`'s cache under `dst_label` copy-on-write (CFG branches, samples, n > 1).

        The fork is a copy of the label, random stream included: a seeded parent's generator is
        cloned as it stands, so a fork called with the parent's seed samples what the parent would
        have (and the same request repeats exactly). Give a branch its own seed to sample apart.
        """
        src = self.seqs.get((request_id, src_label))
        if src is None:
            raise RequestError(f"node '{self.node.name}': request {request_id} has no cache label '{src_label}' to fork")
        if (request_id, dst_label) in self.seqs:
            raise RequestError(f"node '{self.node.name}': cache label '{dst_label}' already exists for {request_id}")
        if src.pending is not None:
            raise RequestError(f"node '{self.node.name}': cannot fork '{src_label}' while a call on it is in flight")
        self._clone(src, dst_label)

    def _clone(self, src: Sequence, dst_label: str) -> Sequence:
        clone = self.blocks.fork(src, dst_label)
        clone.order = next(self._order)
        if src.generator is not None:  # its own generator at the parent's state: the two never share draws
            clone.generator = torch.Generator(device=src.generator.device)
            clone.generator.set_state(src.generator.get_state())
        self.seqs[clone.key] = clone
        return clone

    def drop_label(self, request_id: str, label: str) -> None:
        """Forget one cache label of a request (its pages return to the pool unless shared)."""
        seq = self.seqs.get((request_id, label))
        if seq is None:
            return
        if seq.pending is not None:
            raise RequestError(f"node '{self.node.name}': cannot drop cache label '{label}' while a call on it is in flight")
        del self.seqs[seq.key]
        self.blocks.free(seq)
        forget = getattr(self.backend, "forget", None)
        if forget is not None:
            forget(seq.order)

    def snapshot_label(self, request_id: str, src_label: str, dst_label: str) -> None:
        """Make `dst_label` a copy-on-write copy of `src_label` as it stands (replacing `dst_label`)."""
        if src_label == dst_label:
            return
        self.drop_label(request_id, dst_label)
        src = self.seqs.get((request_id, src_label))
        if src is None:  # snapshot of a label not written yet: an empty label
            src = Sequence(request_id, src_label)
        self._clone(src, dst_label)

    # -- internals --------------------------------------------------------------------------------

    def _parse(self, inv: Invocation) -> ParsedInvocation:
        return parse_invocation(inv, self.vocab_size, self.hidden_size, self.axes, self.call_inputs)

    def _sequence(self, inv: Invocation, parsed: ParsedInvocation) -> Sequence:
        key = (inv.request_id, parsed.label)
        seq = self.seqs.get(key)
        if seq is None:
            if parsed.fork_from is not None:
                self.fork(inv.request_id, parsed.fork_from, parsed.label)
                seq = self.seqs[key]
                if parsed.seed_offset is not None:
                    # a new sample of the parent's tokens (n > 1): its own random stream from seed + offset (set
                    # when this call attaches), nothing generated yet (the parent's tokens are its prompt)
                    seq.generator, seq.sampling, seq.generated = None, None, []
                return seq
            seq = Sequence(inv.request_id, parsed.label, order=next(self._order), arrival=inv.arrival)
            self.seqs[key] = seq
        return seq

    def _attach(self, seq: Sequence, inv: Invocation, parsed: ParsedInvocation) -> None:
        """Make `inv` the sequence's pending call. Everything that can fail runs before the sequence changes."""
        start = 0 if parsed.reset else len(seq.tokens)
        n = len(parsed.ids)
        if self.max_model_len is not None and start + n > self.max_model_len:
            raise RequestError(
                f"node '{self.node.name}': sequence would reach {start + n} tokens, "
                f"over the model's limit of {self.max_model_len}; send a shorter input or fewer max_tokens"
            )
        generator = seq.generator
        if parsed.sampling is not None and (seq.sampling is None or parsed.sampling.seed != seq.sampling.seed):
            generator = self._generator(parsed.sampling.seed)
        if parsed.reset and (seq.tokens or seq.pages):  # the label starts over: a fresh sequence, same name
            self.drop_label(seq.request_id, seq.label)
            seq = Sequence(inv.request_id, parsed.label, order=next(self._order), arrival=inv.arrival)
            self.seqs[seq.key] = seq
        for name in parsed.snapshot_before:
            self.snapshot_label(seq.request_id, seq.label, name)
        limits = mask_limits(start, n, parsed.bidirectional, parsed.frame_size)
        if limits is not None or seq.limits is not None:
            if seq.limits is None:
                seq.limits = list(range(1, start + 1))
            seq.limits.extend(limits or range(start + 1, start + n + 1))
            seq.cacheable = False  # a page's keys depend on tokens after it, not just on those before
        self._append_inputs(seq, parsed, start)
        seq.chunkable = limits is None
        seq.tokens.extend(parsed.ids)
        seq.pending, seq.pending_start, seq.call = inv, start, parsed
        seq.priority = inv.priority
        seq.collected = []
        if parsed.sampling is not None:
            seq.generator, seq.sampling = generator, parsed.sampling

    def _append_inputs(self, seq: Sequence, parsed: ParsedInvocation, start: int) -> None:
        """Record the call's embeddings, positions, routing ids and module tensors at token `start` on."""
        n = len(parsed.ids)
        for offset, rows in parsed.embeds:
            seq.embeds.append((start + offset, rows.to(self.device)))
        if parsed.positions is not None or seq.positions is not None:
            before = seq.positions if seq.positions is not None else torch.arange(start).expand(self.axes, -1)
            new = parsed.positions
            if new is None:  # implicit positions continue after the largest one so far
                new = (torch.arange(n) + seq.next_position).expand(self.axes, -1)
            seq.positions = torch.cat((before, new), dim=1)
        if parsed.routing is not None or seq.routing is not None:
            seq.routing = (seq.routing if seq.routing is not None else [0] * start) + (parsed.routing or [0] * n)
        for name, (value, per_token) in parsed.extras.items():
            seq.extras.append((start, start + n, name, value.to(self.device), per_token))

    def _label(self, request_id: str, label: str) -> Sequence | None:
        """A label read-only calls attend to: this node's, or with `share_cache_with` the partner node's."""
        return (self.seqs if self.partner is None else self.partner.seqs).get((request_id, label))

    def _attach_readers(self) -> None:
        """Attach waiting read-only calls whose labels are all cached (holding references to their pages)."""
        waiting, self.waiting_readers = self.waiting_readers, []
        for inv, parsed in waiting:
            try:
                labels = [self._label(inv.request_id, name) for name in parsed.read_labels]
                if self.share_with is not None and any(s is None for s in labels):
                    missing = [n for n, s in zip(parsed.read_labels, labels, strict=True) if s is None]
                    raise RequestError(f"node '{self.node.name}': node '{self.share_with}' holds no cache label "
                                       f"{missing} for request {inv.request_id}")
                labels = [s for s in labels if s is not None]
                busy = [s for s in labels if s.pending is not None or s.remaining]
                if busy:
                    for s in busy:  # a preempted idle label is recomputed for its readers
                        s.recompute = s.recompute or s.pending is None
                    self.waiting_readers.append((inv, parsed))
                    continue
                self.readers.append(self._reader(inv, parsed, labels))
            except Exception as exc:
                self.answered.append((inv, exc))

    def _reader(self, inv: Invocation, parsed: ParsedInvocation, labels: list[Sequence]) -> Sequence:
        """A read-only call as a transient sequence: the frozen labels' tokens, then its own (never stored)."""
        ctx = sum(len(s.tokens) for s in labels)
        n = len(parsed.ids)
        first = labels[0] if labels else None
        reader = Sequence(inv.request_id, parsed.label, order=next(self._order), arrival=inv.arrival, readonly=True,
                          tokens=[t for s in labels for t in s.tokens] + parsed.ids, num_computed=ctx,
                          context=[(list(s.pages), len(s.tokens)) for s in labels], chunkable=False,
                          generated=list(first.generated) if first else [], priority=inv.priority)
        if any(s.positions is not None for s in labels) or parsed.positions is not None:
            parts = [s.positions if s.positions is not None else torch.arange(len(s.tokens)).expand(self.axes, -1)
                     for s in labels]
            reader.positions = torch.cat(parts, dim=1) if parts else torch.zeros(self.axes, 0, dtype=torch.long)
            reader.tokens = reader.tokens[:ctx]  # (next_position counts tokens so far)
            new = parsed.positions
            if new is None:
                new = (torch.arange(n) + reader.next_position).expand(self.axes, -1)
            reader.positions = torch.cat((reader.positions, new), dim=1)
            reader.tokens.extend(parsed.ids)
        limits = mask_limits(ctx, n, parsed.bidirectional, parsed.frame_size)
        if limits is not None:
            reader.limits = [0] * ctx + limits  # only the own rows' bounds are read
        self._append_inputs_reader(reader, parsed, ctx)
        sampling = parsed.sampling or (first.sampling if first else None)
        reader.sampling = sampling
        if parsed.sampling is not None and (first is None or first.sampling is None
                                            or parsed.sampling.seed != first.sampling.seed):
            reader.generator = self._generator(parsed.sampling.seed)
        elif first is not None:
            reader.generator = first.generator  # today's semantics: the label's random stream advances
        for pages, _ in reader.context:
            for page in pages:
                self.pool.incref(page)
        reader.pending, reader.pending_start, reader.call = inv, ctx, parsed
        return reader

    def _append_inputs_reader(self, reader: Sequence, parsed: ParsedInvocation, ctx: int) -> None:
        n = len(parsed.ids)
        for offset, rows in parsed.embeds:
            reader.embeds.append((ctx + offset, rows.to(self.device)))
        if parsed.routing is not None:
            reader.routing = [0] * ctx + parsed.routing
        for name, (value, per_token) in parsed.extras.items():
            reader.extras.append((ctx, ctx + n, name, value.to(self.device), per_token))

    def _drop_reader(self, reader: Sequence) -> None:
        if reader in self.readers:
            self.readers.remove(reader)
            for pages, _ in reader.context:
                for page in pages:
                    self.pool.decref(page)
            reader.context = []

    def _generator(self, seed: Any) -> torch.Generator | None:
        if seed is None:
            return None
        gen = torch.Generator(device=self.device)
        try:
            gen.manual_seed(seed)
        except (TypeError, ValueError, OverflowError, RuntimeError):
            # the edge checks seeds, but params can arrive by other paths: this one request fails, not the node
            raise RequestError(f"node '{self.node.name}': sampling 'seed' must be an integer in [0, 2**63 - 1], "
                               f"got {seed!r:.40}") from None
        return gen

    def _forward(self, work: list[tuple[Sequence, int]]) -> torch.Tensor:
        ids, batch = build_batch(work, self.pool.page_size, self.device)
        positions = rope_positions(work, batch, self.axes)
        kwargs = self._module_inputs(work, batch)
        embeds = self._splice_embeds(work, ids)
        context = self.backend.begin(batch, self.pool.kv)
        with torch.inference_mode():
            if embeds is None:
                return self.forward_fn(ids, positions, context, **kwargs)
            return self.forward_fn(None, positions, context, input_embeds=embeds, **kwargs)

    def _module_inputs(self, work: list[tuple[Sequence, int]], batch: Any) -> dict[str, torch.Tensor]:
        """Routing ids and module-declared tensors for the step's rows (zeros where a call gave none)."""
        out: dict[str, torch.Tensor] = {}
        if self.routed:
            parts = [seq.routing[seq.num_computed : seq.num_computed + n] if seq.routing is not None else [0] * n
                     for seq, n in work]
            out["routing"] = torch.tensor([r for p in parts for r in p], dtype=torch.long, device=self.device)
        if not self.call_inputs:
            return out
        per_seq = False
        for name, kind in self.call_inputs.items():
            found = [(seq, n, [e for e in seq.extras if e[2] == name and e[0] < seq.num_computed + n
                               and e[1] > seq.num_computed]) for seq, n in work]
            sample = next((e[0][3] for _, _, e in found if e), None)
            if sample is None:
                continue
            if kind == "token":
                rows = []
                for seq, n, entries in found:
                    part = sample.new_zeros(n, *sample.shape[1:])
                    lo = seq.num_computed
                    for start, end, _, value, _ in entries:
                        a, b = max(lo, start), min(lo + n, end)
                        part[a - lo : b - lo] = value[a - start : b - start]
                    rows.append(part)
                out[name] = torch.cat(rows)
            else:
                per_seq = True
                out[name] = torch.stack([e[-1][3] if e else sample.new_zeros(sample.shape) for _, _, e in found])
        if per_seq:
            lens = torch.tensor([n for _, n in work], device=self.device)
            out["sequence_index"] = torch.repeat_interleave(torch.arange(len(work), device=self.device), lens)
        return out

    def _splice_embeds(self, work: list[tuple[Sequence, int]], ids: torch.Tensor) -> torch.Tensor | None:
        if not any(seq.embeds for seq, _ in work):
            return None
        spans = []
        row = 0
        for seq, n in work:
            lo, hi = seq.num_computed, seq.num_computed + n
            for start, rows in seq.embeds:
                a, b = max(lo, start), min(hi, start + rows.shape[0])
                if a < b:
                    spans.append((row + a - lo, row + b - lo, rows[a - start : b - start]))
            row += n
        with torch.inference_mode():
            if sum(b - a for a, b, _ in spans) == row:  # every row is an embedding: no token embedding needed
                embeds = spans[0][2].new_empty(row, spans[0][2].shape[1], dtype=self.dtype)
            else:
                embeds = self.module.embed(ids)
            for a, b, rows in spans:
                embeds[a:b] = rows.to(embeds.dtype)
        return embeds

    def _run(self, work: list[tuple[Sequence, int]]) -> list[Result]:
        """Forward `work`, advance its sequences, and answer those whose input is now all computed."""
        try:
            hidden = self._forward(work)
        except Exception as exc:
            if len(work) == 1:
                if work[0][0].pending is None:  # a recompute for readers: they keep waiting
                    work[0][0].recompute = False
                    return []
                return [self._fail(work[0][0], exc)]
            # One sequence's input may be what breaks the batch: run each alone so only the culprit
            # fails. Nothing advanced, so a retry just rewrites the same positions' KV.
            return [r for item in work for r in self._run([item])]
        done: list[tuple[Sequence, int]] = []
        row = 0
        for seq, n in work:
            # rows before the call's first token are a recompute (after preemption), not the call's output
            lo = row + max(0, seq.pending_start - seq.num_computed)
            row += n
            seq.num_computed += n
            if not seq.readonly:
                self.blocks.commit(seq)
            if not self.samples and seq.call is not None and lo < row:
                keep_all = seq.call.output_rows == "all" or seq.call.output_index is not None
                seq.collected.append(hidden[lo:row] if keep_all else hidden[row - 1 : row])
            if seq.remaining == 0:
                if seq.pending is not None:
                    done.append((seq, row - 1))
                else:
                    seq.recompute = False
        if not done:
            return []
        return self._finish(done, hidden) if self.samples else self._finish_rows(done)

    def _finish_rows(self, done: list[tuple[Sequence, int]]) -> list[Result]:
        """Per-token outputs: the calls' rows of hidden states and the module's outputs computed from them."""
        rows = []
        for seq, _ in done:
            got = torch.cat(seq.collected) if len(seq.collected) > 1 else seq.collected[0]
            call = seq.call
            if call.output_index is not None:
                got = got[call.output_index.to(got.device)]
            elif call.output_rows == "last":
                got = got[-1:]
            rows.append(got)
            seq.collected = []
        computed: dict[str, list[torch.Tensor]] = {}
        try:
            with torch.inference_mode():
                joined = torch.cat(rows)
                for name in self.extra_outputs:
                    computed[name] = list(getattr(self.module, f"compute_{name}")(joined).split([r.shape[0] for r in rows]))
        except Exception as exc:
            return [self._fail(seq, exc) for seq, _ in done]
        results = []
        for i, (seq, _) in enumerate(done):
            out: dict[str, Any] = {}
            if "hidden" in self.node.outputs:
                out["hidden"] = rows[i]
            for name, values in computed.items():
                out[name] = values[i]
            results.append(self._complete(seq, out))
        return results

    def _finish(self, done: list[tuple[Sequence, int]], hidden: torch.Tensor) -> list[Result]:
        last = hidden[torch.tensor([r for _, r in done], device=hidden.device)]
        seqs = [s for s, _ in done]
        try:
            logits, picked = self._sample(seqs, last)
        except Exception:
            # One row's parameters broke the batched sampling: sample each row alone so only it fails.
            # (The sampler draws last, so no row's generator advanced before the failure.)
            return [self._finish_alone(seq, last[i : i + 1]) for i, seq in enumerate(seqs)]
        return [self._answer(seq, i, logits, picked, last) for i, seq in enumerate(seqs)]

    def _finish_alone(self, seq: Sequence, last: torch.Tensor) -> Result:
        try:
            logits, picked = self._sample([seq], last)
        except Exception as exc:
            return self._fail(seq, exc)
        return self._answer(seq, 0, logits, picked, last)

    def _sample(self, seqs: list[Sequence], last: torch.Tensor) -> tuple[torch.Tensor, Sampled]:
        with torch.inference_mode():
            logits = self.module.compute_logits(last)
            # a log-softmax normaliser over the vocabulary per row: only when a request asked for it
            wanted = "logprob" in self.node.outputs and any(s.sampling and s.sampling.logprobs is not None for s in seqs)
            picked = sample(logits, [s.sampling for s in seqs], [s.generator for s in seqs], [s.tokens for s in seqs],
                            logprobs=wanted, generated=[s.generated for s in seqs])
        return logits, picked

    def _answer(self, seq: Sequence, i: int, logits: torch.Tensor, picked: Sampled, last: torch.Tensor) -> Result:
        """Row `i`'s outputs; the call is done, and the label's next queued call (if any) attaches."""
        token = picked.tokens[i]
        keep = not seq.readonly
        if keep:
            seq.generated.append(token)
        try:
            out: dict[str, Any] = {
                "next_token": token,
                "finish_reason": self._finish_reason(seq, token),
            }
        except Exception as exc:  # e.g. stop lists no validation vetted: this request alone fails
            if keep:
                seq.generated.pop()
            return self._fail(seq, exc)
        if picked.logprobs[i] is not None:
            out["logprob"] = picked.logprobs[i]
        if picked.top_logprobs[i] is not None:
            out["top_logprobs"] = picked.top_logprobs[i]
        if "logits" in self.node.outputs:
            out["logits"] = logits[i]
        if "hidden" in self.node.outputs:
            out["hidden"] = last[i]
        return self._complete(seq, out)

    def _complete(self, seq: Sequence, out: dict[str, Any]) -> Result:
        """Answer the sequence's call with `out`; run its after-call label operations; attach what waits."""
        inv, call = seq.pending, seq.call
        seq.pending, seq.call = None, None
        if seq.readonly:
            self._drop_reader(seq)
        try:
            for name in () if seq.readonly else call.snapshot_after:
                self.snapshot_label(seq.request_id, seq.label, name)
            for name in call.drop:
                self.drop_label(seq.request_id, name)
        except Exception as exc:
            if not seq.readonly:
                self._attach_backlog(seq)
            return (inv, exc)
        if seq.readonly:
            return (inv, out)
        self._attach_backlog(seq)
        return (inv, out)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.sampling
        if params is None:
            return None
        if token in params.stop_token_ids:
            return "stop"
        for stop in params.stop_sequences:
            if len(seq.generated) >= len(stop) and tuple(seq.generated[-len(stop) :]) == stop:
                return "stop"
        if len(seq.generated) >= params.max_tokens:
            return "length"
        return None

    def _fail(self, seq: Sequence, exc: BaseException) -> Result:
        inv = seq.pending
        seq.pending, seq.call, seq.collected = None, None, []
        if seq.readonly:
            self._drop_reader(seq)
            return (inv, exc)
        self.blocks.truncate(seq, seq.pending_start)
        self._attach_backlog(seq)
        return (inv, exc)

    def _attach_backlog(self, seq: Sequence) -> None:
        for inv in list(self.backlog):
            if inv.request_id == seq.request_id and inv.options.get("cache_label", "main") == seq.label:
                self.backlog.remove(inv)
                try:
                    parsed = self._parse(inv)
                    self._attach(self.seqs.get(seq.key) or self._sequence(inv, parsed), inv, parsed)
                except Exception as exc:
                    self.answered.append((inv, exc))
                    continue
                return
