"""`KVCacheEngine` (kind `kvcache`): continuous batching of autoregressive calls over a paged KV pool."""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any

import torch

from mstar_core.errors import RequestError
from mstar_core.runtime.engine import Engine, EngineContext, Invocation, Result
from mstar_kvcache.batch import build_batch
from mstar_kvcache.blocks import BlockManager
from mstar_kvcache.config import KVCacheSettings, kv_shape, select_backend
from mstar_kvcache.contract import KVCacheModule, check_kvcache_module
from mstar_kvcache.inputs import ParsedInvocation, mask_limits, parse_invocation
from mstar_kvcache.pool import PagePool
from mstar_kvcache.sampler import Sampled, sample
from mstar_kvcache.scheduler import Scheduler
from mstar_kvcache.sequence import Sequence
from mstar_kvcache.snapshot import CacheSnapshot


class KVCacheEngine(Engine):
    """Each invocation appends `input_ids` to the request's sequence for its cache label, then samples.

    Outputs: `next_token`, `finish_reason` (None, "stop" or "length"), plus `top_logprobs` when
    the sampling params ask, `logprob` when the node declares it and the sampling params ask
    (`logprobs` set), and `logits` / `hidden` (last position) when the node declares those.
    Options: `cache_label` (default "main"), `write_cache` (False: attend to the cache without
    keeping this call's tokens), `fork_from` (a new label starts as a copy-on-write fork of that
    label), `bidirectional` (this call's tokens form one bidirectional block), `frame_size`
    (frame-causal mask), `transfer` ("export" / "import": move the request's caches between
    engines, see `export_cache`). Larger `Invocation.priority` is scheduled first.
    """

    kind = "kvcache"
    moves_state = True
    module_contract = KVCacheModule

    def __init__(self, node: Any, module: Any, context: EngineContext):
        super().__init__(node, module, context)
        check_kvcache_module(module, node)  # at load: a module missing a method fails here, not on a request
        self.settings = KVCacheSettings.from_mapping(context.settings)
        self.device = torch.device(context.device)
        layers, kv_heads, head_dim, self.vocab_size, self.hidden_size = kv_shape(module)
        first = next(iter(module.parameters()), None) if hasattr(module, "parameters") else None
        dtype = torch.float32 if first is None else first.dtype
        num_pages = self.settings.resolve_num_pages(layers, kv_heads, head_dim, dtype)
        self.pool = PagePool(num_pages, self.settings.page_size, layers, kv_heads, head_dim, dtype, self.device)
        self.blocks = BlockManager(self.pool, self.settings.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, self.settings.max_num_seqs, self.settings.max_num_batched_tokens)
        self.backend = select_backend(self.settings.attention_backend, self.device, context.registry)
        self.max_model_len = getattr(getattr(module, "config", None), "max_position_embeddings", None)
        self.seqs: dict[tuple[str, str], Sequence] = {}
        self.backlog: deque[Invocation] = deque()  # calls for a label that already has one in flight
        self.answered: list[Result] = []  # answered without a forward pass: rejections and state transfers
        self._order = itertools.count()
        self.num_preemptions = 0
        self.num_steps = 0

    @property
    def max_batch_size(self) -> int:
        return int(self.context.settings.get("max_batch_size", 4 * self.settings.max_num_seqs))

    # -- contract ---------------------------------------------------------------------------------

    def add(self, invocation: Invocation) -> None:
        transfer = invocation.options.get("transfer")
        if transfer is not None:
            answer = self._transfer(invocation, transfer)  # (an export releases, which rebuilds `answered`)
            self.answered.append((invocation, answer))
            return
        # whatever this invocation's inputs trigger here (parsing, seeding, attaching) answers it alone
        try:
            parsed = parse_invocation(invocation, self.vocab_size, self.hidden_size)
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
        return bool(self.answered) or any(s.pending is not None for s in self.seqs.values())

    def step(self) -> list[Result]:
        results, self.answered = self.answered, []
        pending = [s for s in self.seqs.values() if s.pending is not None]
        if not pending:
            return results
        plan = self.scheduler.schedule(pending, self.seqs.values)
        self.num_preemptions += len(plan.preempted)
        for seq in plan.too_large:
            need = self.blocks.total_pages(seq)
            results.append(self._fail(seq, RequestError(
                f"node '{self.node.name}': sequence needs {need} KV pages but the pool has {self.pool.num_pages}; "
                "raise the node's num_pages (or kv_cache_bytes) setting or send a shorter input", status=413)))
        if not plan.work:
            return results
        self.num_steps += 1
        results.extend(self._run(plan.work))
        return results

    def release(self, request_id: str) -> None:
        forget = getattr(self.backend, "forget", None)  # backends may keep per-sequence state (decode lanes)
        for key in [k for k in self.seqs if k[0] == request_id]:
            seq = self.seqs.pop(key)
            self.blocks.free(seq)
            if forget is not None:
                forget(seq.order)
        self.backlog = deque(inv for inv in self.backlog if inv.request_id != request_id)
        self.answered = [r for r in self.answered if r[0].request_id != request_id]

    def active_requests(self) -> set[str]:
        return {k[0] for k in self.seqs} | {i.request_id for i in self.backlog} | {r[0].request_id for r in self.answered}

    def stats(self) -> dict[str, float]:
        pending = [s for s in self.seqs.values() if s.pending is not None]
        return {
            "kv_pages_total": self.pool.num_pages,
            "kv_pages_used": self.pool.num_used,
            "kv_pages_cached": self.pool.num_cached,
            "kv_page_copies": self.pool.copies,
            "kv_prefix_hit_pages": self.pool.hits,
            "num_preemptions": self.num_preemptions,
            "num_running": sum(1 for s in pending if s.pages),
            "num_waiting": sum(1 for s in pending if not s.pages),
        }

    def close(self) -> None:
        for seq in self.seqs.values():
            self.blocks.free(seq)
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
        clone = self.blocks.fork(src, dst_label)
        clone.order = next(self._order)
        if src.generator is not None:  # its own generator at the parent's state: the two never share draws
            clone.generator = torch.Generator(device=src.generator.device)
            clone.generator.set_state(src.generator.get_state())
        self.seqs[clone.key] = clone

    def export_cache(self, request_id: str, label: str = "main") -> CacheSnapshot:
        """A copy of one label's cache and sampling state, for `import_cache` in another engine.

        Only between calls: the label's tokens must all be cached and no call may be in flight.
        """
        seq = self.seqs.get((request_id, label))
        if seq is None:
            raise RequestError(f"node '{self.node.name}': request {request_id} has no cache label '{label}' to export")
        if seq.pending is not None or seq.remaining:
            raise RequestError(f"node '{self.node.name}': cache label '{label}' of {request_id} is mid-call; "
                               "export it between calls")
        n = seq.num_computed
        pages = torch.tensor(seq.pages, dtype=torch.long, device=self.pool.kv.device)
        kv = self.pool.kv.index_select(2, pages).flatten(2, 3)[:, :, :n].clone()
        return CacheSnapshot(
            label=label,
            tokens=list(seq.tokens),
            generated=list(seq.generated),
            kv=kv,
            sampling=seq.sampling,
            generator_state=None if seq.generator is None else seq.generator.get_state(),
            limits=None if seq.limits is None else list(seq.limits),
            embeds=list(seq.embeds),
            cacheable=seq.cacheable,
        )

    def import_cache(self, request_id: str, snapshot: CacheSnapshot) -> None:
        """Make `snapshot` this request's cache label, as if its tokens had been computed here.

        Raises `RequestError` if the label exists, the shape does not match this model's KV, or
        the pool cannot hold it now (503: retry when requests finish; 413: it can never fit).
        """
        key = (request_id, snapshot.label)
        if key in self.seqs:
            raise RequestError(f"node '{self.node.name}': cache label '{snapshot.label}' already exists for {request_id}")
        layers, _, _, _, heads, dim = self.pool.kv.shape
        want = (layers, 2, len(snapshot.tokens), heads, dim)
        if tuple(snapshot.kv.shape) != want:
            raise RequestError(f"node '{self.node.name}': cache snapshot has KV shape {tuple(snapshot.kv.shape)}, "
                               f"this model needs {want}")
        seq = Sequence(request_id, snapshot.label, tokens=list(snapshot.tokens), order=next(self._order),
                       generated=list(snapshot.generated), sampling=snapshot.sampling,
                       limits=None if snapshot.limits is None else list(snapshot.limits),
                       embeds=[(start, rows.to(self.device)) for start, rows in snapshot.embeds],
                       cacheable=snapshot.cacheable)
        n = len(seq.tokens)
        if self.blocks.total_pages(seq) > self.pool.num_pages:
            raise RequestError(f"node '{self.node.name}': the snapshot needs {self.blocks.total_pages(seq)} KV pages, "
                               f"the pool has {self.pool.num_pages}", status=413)
        if not self.blocks.reserve(seq, n):
            raise RequestError(f"node '{self.node.name}': no KV pages free for the snapshot now; retry later", status=503)
        filled = self.pool.kv.new_zeros(layers, 2, len(seq.pages) * self.pool.page_size, heads, dim)
        filled[:, :, :n] = snapshot.kv
        pages = torch.tensor(seq.pages, dtype=torch.long, device=self.pool.kv.device)
        self.pool.kv.index_copy_(2, pages, filled.unflatten(2, (len(seq.pages), self.pool.page_size)))
        seq.num_computed = n
        self.blocks.commit(seq)
        if snapshot.generator_state is not None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.set_state(snapshot.generator_state)
        self.seqs[key] = seq

    def _transfer(self, inv: Invocation, op: str) -> dict[str, Any] | RequestError:
        """Answer a transfer invocation: every cache label of the request leaves (export) or arrives (import)."""
        try:
            if op == "export":
                labels = [label for rid, label in self.seqs if rid == inv.request_id]
                state = {"labels": [self.export_cache(inv.request_id, label).to_plain() for label in labels]}
                self.release(inv.request_id)  # moved, not copied: the pages here are free again
                return {"state": state}
            if op == "import":
                state = inv.inputs.get("state")
                if not isinstance(state, dict) or not isinstance(state.get("labels"), list):
                    raise RequestError(f"node '{self.node.name}': import needs input 'state' as an export produced it")
                for plain in state["labels"]:
                    self.import_cache(inv.request_id, CacheSnapshot.from_plain(plain))
                return {}
            raise RequestError(f"node '{self.node.name}': unknown transfer {op!r}; use 'export' or 'import'")
        except Exception as exc:  # (an export only releases once every label is copied)
            return exc

    # -- internals --------------------------------------------------------------------------------

    def _sequence(self, inv: Invocation, parsed: ParsedInvocation) -> Sequence:
        key = (inv.request_id, parsed.label)
        seq = self.seqs.get(key)
        if seq is None:
            if parsed.fork_from is not None:
                self.fork(inv.request_id, parsed.fork_from, parsed.label)
                return self.seqs[key]
            seq = Sequence(inv.request_id, parsed.label, order=next(self._order), arrival=inv.arrival)
            self.seqs[key] = seq
        return seq

    def _attach(self, seq: Sequence, inv: Invocation, parsed: ParsedInvocation) -> None:
        """Make `inv` the sequence's pending call. Everything that can fail runs before the sequence changes."""
        start = len(seq.tokens)
        if self.max_model_len is not None and start + len(parsed.ids) > self.max_model_len:
            raise RequestError(
                f"node '{self.node.name}': sequence would reach {start + len(parsed.ids)} tokens, "
                f"over the model's limit of {self.max_model_len}; send a shorter input or fewer max_tokens"
            )
        generator = seq.generator
        if parsed.sampling is not None and (seq.sampling is None or parsed.sampling.seed != seq.sampling.seed):
            generator = self._generator(parsed.sampling.seed)
        embeds = None if parsed.embeds is None else parsed.embeds.to(self.device)
        limits = mask_limits(start, len(parsed.ids), parsed.bidirectional, parsed.frame_size)
        if limits is not None or seq.limits is not None:
            if seq.limits is None:
                seq.limits = list(range(1, start + 1))
            seq.limits.extend(limits or range(start + 1, start + len(parsed.ids) + 1))
            seq.cacheable = False  # page contents depend on the mask, not just the tokens
        if embeds is not None:
            seq.embeds.append((start, embeds))
            seq.cacheable = False
        seq.chunkable = limits is None
        seq.tokens.extend(parsed.ids)
        seq.pending, seq.pending_start = inv, start
        seq.priority = inv.priority
        if parsed.sampling is not None:
            seq.generator, seq.sampling = generator, parsed.sampling

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
        embeds = self._splice_embeds(work, ids)
        context = self.backend.begin(batch, self.pool.kv)
        with torch.inference_mode():
            if embeds is None:
                return self.module(ids, batch.positions, context)
            return self.module(None, batch.positions, context, input_embeds=embeds)

    def _splice_embeds(self, work: list[tuple[Sequence, int]], ids: torch.Tensor) -> torch.Tensor | None:
        if not any(seq.embeds for seq, _ in work):
            return None
        with torch.inference_mode():
            embeds = self.module.embed(ids)
            row = 0
            for seq, n in work:
                lo, hi = seq.num_computed, seq.num_computed + n
                for start, rows in seq.embeds:
                    a, b = max(lo, start), min(hi, start + rows.shape[0])
                    if a < b:
                        embeds[row + a - lo : row + b - lo] = rows[a - start : b - start].to(embeds.dtype)
                row += n
        return embeds

    def _run(self, work: list[tuple[Sequence, int]]) -> list[Result]:
        """Forward `work`, advance its sequences, and answer those whose input is now all computed."""
        try:
            hidden = self._forward(work)
        except Exception as exc:
            if len(work) == 1:
                return [self._fail(work[0][0], exc)]
            # One sequence's input may be what breaks the batch: run each alone so only the culprit
            # fails. Nothing advanced, so a retry just rewrites the same positions' KV.
            return [r for item in work for r in self._run([item])]
        done: list[tuple[Sequence, int]] = []
        row = 0
        for seq, n in work:
            row += n
            seq.num_computed += n
            if seq.pending.options.get("write_cache", True):
                self.blocks.commit(seq)
            if seq.remaining == 0:
                done.append((seq, row - 1))
        return self._finish(done, hidden) if done else []

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
                            logprobs=wanted)
        return logits, picked

    def _answer(self, seq: Sequence, i: int, logits: torch.Tensor, picked: Sampled, last: torch.Tensor) -> Result:
        """Row `i`'s outputs; the call is done, and the label's next queued call (if any) attaches."""
        inv = seq.pending
        token = picked.tokens[i]
        keep = inv.options.get("write_cache", True)
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
        if not keep:
            self.blocks.truncate(seq, seq.pending_start)
        seq.pending = None
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
        self.blocks.truncate(seq, seq.pending_start)
        seq.pending = None
        self._attach_backlog(seq)
        return (inv, exc)

    def _attach_backlog(self, seq: Sequence) -> None:
        for inv in list(self.backlog):
            if inv.request_id == seq.request_id and inv.options.get("cache_label", "main") == seq.label:
                self.backlog.remove(inv)
                try:
                    self._attach(seq, inv, parse_invocation(inv, self.vocab_size, self.hidden_size))
                except Exception as exc:
                    self.answered.append((inv, exc))
                    continue
                return
