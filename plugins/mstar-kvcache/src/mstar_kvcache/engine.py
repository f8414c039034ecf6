"""`KVCacheEngine` (kind `kvcache`): continuous batching of transformer calls over a paged KV pool."""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Any

import torch

from mstar_core.errors import RequestError
from mstar_core.graph.options import check_call_options
from mstar_core.runtime.engine import Engine, EngineContext, Invocation, Result
from mstar_kvcache.answers import CallAnswers
from mstar_kvcache.blocks import BlockManager
from mstar_kvcache.config import KVCacheSettings, kv_shape, select_backend
from mstar_kvcache.contract import BUILTIN_OUTPUTS, KVCacheModule, call_inputs, check_kvcache_module, samples
from mstar_kvcache.inputs import OPTIONS, ParsedInvocation, mask_limits, parse_invocation
from mstar_kvcache.labels import CacheLabels
from mstar_kvcache.no_token import NoTokenColumns
from mstar_kvcache.offload import host_tier
from mstar_kvcache.ranks import RankSteps, split_shape
from mstar_kvcache.readers import ReadOnlyCalls
from mstar_kvcache.replay import StepReplay
from mstar_kvcache.scheduler import Scheduler
from mstar_kvcache.sequence import Sequence
from mstar_kvcache.sharing import cache_owner
from mstar_kvcache.step_inputs import StepInputs
from mstar_kvcache.transfer import CacheTransfer


class KVCacheEngine(CacheLabels, ReadOnlyCalls, StepInputs, CallAnswers, CacheTransfer, RankSteps, Engine):
    """Runs a transformer node's calls over paged KV, many requests and cache labels per forward.

    What a call takes and returns is in `inputs.py` (inputs and options) and `contract.py` (what
    the module provides). A node that declares `next_token` samples: outputs `next_token`,
    `finish_reason`, and when declared `logprob` / `top_logprobs` (as the sampling params ask),
    `logits` and `hidden` of the last row; a sampling call that asks (option `output_rows` or input
    `output_index`) also gets each `compute_<name>` output over its rows, as below. Any other node
    returns per-token rows with no vocabulary projection: `hidden` and each `compute_<name>` output,
    for every row of the call (`output_rows: "all"`, the default), the last one, or the rows at input
    `output_index`.

    A call appends its tokens to its cache label and attends to everything before them; with
    `write_cache: False` it is read-only: it attends to the frozen `read_labels` (default its
    `cache_label`) plus its own tokens, which are never stored, and takes no page. Larger
    `Invocation.priority` is scheduled first.

    This file holds the engine contract and how a call attaches to its label; the rest lives in
    mixins, one job each: `labels.py` (fork, snapshot, drop), `readers.py` (read-only calls),
    `step_inputs.py` (one step's forward), `answers.py` (results, sampling, failures), and
    `transfer.py` (moving caches between engines), `ranks.py` (a node split across a rank group).
    """

    kind = "kvcache"
    moves_state = True
    module_contract = KVCacheModule
    call_options = frozenset(OPTIONS)  # Graph.build checks every walk's calls against these
    node_ref_options = frozenset({"share_cache_with"})

    def __init__(self, node: Any, module: Any, context: EngineContext):
        super().__init__(node, module, context)
        check_kvcache_module(module, node)  # at load: a module missing a method fails here, not on a request
        # graphs built before this plugin was imported were not checked by Graph.build: check their calls now
        check_call_options(node.name, self.kind, getattr(node, "call_sites", ()), OPTIONS, node.options)
        self.settings = KVCacheSettings.from_mapping(context.settings)
        self.device = torch.device(context.device)
        layers, kv_heads, head_dim, self.vocab_size, self.hidden_size = kv_shape(module)
        self.ranks = context.rank_group  # None unless the node is split across processes (see ranks.py)
        self._forgotten: list[int] = []  # sequences released since the last step message (rank 0)
        if self.ranks is not None:
            kv_heads = split_shape(module, self.ranks, node.name, kv_heads)
        first = next(iter(module.parameters()), None) if hasattr(module, "parameters") else None
        self.dtype = dtype = torch.float32 if first is None else first.dtype
        self.samples = samples(node)
        self.axes = int(getattr(module, "position_axes", 1) or 1)
        self.call_inputs = {k: v for k, v in call_inputs(module, node.name).items() if k in node.all_inputs}
        self.routed = "routing" in node.all_inputs
        self.extra_outputs = [o for o in node.outputs if o not in BUILTIN_OUTPUTS]
        self.returns_logits, self.returns_hidden = "logits" in node.outputs, "hidden" in node.outputs
        self.share_with = node.options.get("share_cache_with")
        self.kv_shape = (layers, kv_heads, head_dim, dtype)
        # a reader of another node's labels uses that node's pool (see sharing.py); every other node owns its own
        self.partner = None if self.share_with is None else cache_owner(self, self.share_with, self.kv_shape)
        if self.partner is not None:
            self.pool = self.partner.pool
        else:
            pages = self.settings.resolve_num_pages(layers, kv_heads, head_dim, dtype)
            self.pool = self._pool_class()(pages, self.settings.page_size, layers, kv_heads, head_dim, dtype,
                                           self.device)
        self.offload = host_tier(self.settings.kv_offload, self.pool, node.name, self.ranks, self.share_with)
        self.blocks = BlockManager(self.pool, self.settings.enable_prefix_caching, salt=node.name, host=self.offload)
        self.scheduler = Scheduler(self.blocks, self.settings.max_num_seqs, self.settings.max_num_batched_tokens)
        self.backend = select_backend(self.settings.attention_backend, self.device, context.registry)
        self.quantized_linears = 0
        if self.settings.quantize is not None and isinstance(module, torch.nn.Module):
            from mstar_core.nn.quant import check_mode, quantize_linears

            check_mode(self.settings.quantize, self.device, f"node '{node.name}': kvcache setting 'quantize'")
            self.quantized_linears = quantize_linears(module, self.settings.quantize)  # before packing: fewer left to pack
        self.packed_linears = 0
        if self.settings.pack_weights is not False and self.device.type == "cpu" and isinstance(module, torch.nn.Module):
            from mstar_core.nn.packed import pack_linears

            self.packed_linears = pack_linears(module)  # a CPU step's wide GEMMs stop repacking their weights
        self.forward_fn = module if not self.settings.compile else self._compiled(module)
        self.replay = None
        if self.settings.replay_steps is not False and not self.settings.compile and self.ranks is None:
            self.replay = StepReplay.for_module(module, node.name, self.device)
        if self.settings.compile and self.ranks is not None and not self.routed:
            # a split node compiles every bucket now, while its worker loads: compiling mid-serving (tens of
            # seconds of Python) starved a loaded rank's heartbeats and its group was replaced. Every rank
            # builds its engines in the same order before it follows a step, so their collectives line up.
            embeds = "input_embeds" in node.all_inputs and self.hidden_size is not None
            self.forward_fn.warm_up(axes=self.axes, hidden=self.hidden_size if embeds else None, dtype=dtype)
        self.max_model_len = getattr(getattr(module, "config", None), "max_position_embeddings", None)
        self.grammar_vocab = getattr(module, "grammar_vocab", None)  # what sampling grammars compile against
        self.no_token = NoTokenColumns.of(self.grammar_vocab, self.vocab_size, self.device)  # padding: never sampled
        self.seqs: dict[tuple[str, str], Sequence] = {}
        self.backlog: deque[Invocation] = deque()  # calls for a label that already has one in flight
        self.answered: list[Result] = []  # answered without a forward pass: rejections and state transfers
        self.waiting_readers: list[tuple[Invocation, ParsedInvocation]] = []  # read-only calls not attached yet
        self.readers: list[Sequence] = []  # attached read-only calls (they hold references to their pages)
        self._order = itertools.count()
        self.num_preemptions = 0
        self.num_steps = 0
        self.tokens_forwarded = 0  # rows computed by forwards (prefill and decode; prefix-cache hits are not)
        self.largest_batch = 0  # most sequences (calls, labels) one forward has run so far
        if self.ranks is not None and self.ranks.leader:
            self._lead()

    @property
    def max_batch_size(self) -> int:
        return int(self.context.settings.get("max_batch_size", 4 * self.settings.max_num_seqs))

    def _compiled(self, module: Any) -> Any:
        from mstar_kvcache.compiled import CompiledForward, default_buckets

        buckets = self.settings.compile_buckets or default_buckets(self.settings.max_num_batched_tokens)
        return CompiledForward(module, self.device, buckets, cuda_graphs=self.settings.cuda_graphs, node=self.node.name,
                               split=self.ranks is not None)

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
        if self.offload is not None:
            self.offload.load(plan.work)  # restored sequences get their keys and values back before the forward
        self.num_preemptions += len(plan.preempted)
        for seq in plan.preempted:  # recomputed from its first token: its call's rows are gathered again
            if seq.host is None:  # (an offloaded one continues where it stopped, rows gathered so far kept)
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
        started = time.perf_counter()
        results.extend(self._run(plan.work))
        if self.offload is not None:  # what a step costs per token: rule `auto` weighs recomputes with it
            self.offload.costs.observe_step(plan.num_tokens, time.perf_counter() - started)
        return results

    def release(self, request_id: str) -> None:
        forget = getattr(self.backend, "forget", None)  # backends may keep per-sequence state (decode lanes)
        for key in [k for k in self.seqs if k[0] == request_id]:
            seq = self.seqs.pop(key)
            self.blocks.discard(seq)
            if forget is not None:
                forget(seq.order)
                if self.ranks is not None:
                    self._forgotten.append(seq.order)
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
            "tokens_forwarded": self.tokens_forwarded,
            "num_preemptions": self.num_preemptions,
            "largest_batch": self.largest_batch,
            "packed_linears": self.packed_linears,
            **({"replayed_steps": self.replay.replayed, "recorded_steps": self.replay.recorded}
               if self.replay is not None else {}),
            "quantized_linears": self.quantized_linears,
            "num_running": sum(1 for s in pending if s.pages) + len(self.readers),
            "num_waiting": sum(1 for s in pending if not s.pages) + len(self.waiting_readers),
            **({"compile_seconds": self.forward_fn.compile_seconds} if self.settings.compile else {}),
            **(self.offload.stats() if self.offload is not None else {}),
            # this process's share of the KV pool (a split node's pool holds only its rank's heads)
            "kv_heads": self.kv_shape[1],
            "kv_pool_bytes": self.pool.kv.numel() * self.pool.kv.element_size(),
            **({"tensor_parallel_rank": self.ranks.rank, "tensor_parallel_size": self.ranks.world_size}
               if self.ranks is not None else {}),
        }

    def close(self) -> None:
        for seq in self.seqs.values():
            self.blocks.discard(seq)
        for reader in list(self.readers):
            self._drop_reader(reader)
        self.seqs.clear()

    # -- internals --------------------------------------------------------------------------------

    def _parse(self, inv: Invocation) -> ParsedInvocation:
        return parse_invocation(inv, self.vocab_size, self.hidden_size, self.axes, self.call_inputs)

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
        limits = None
        if parsed.bidirectional or parsed.frame_size is not None or parsed.blocks is not None:
            limits = mask_limits(start, n, parsed.bidirectional, parsed.frame_size, parsed.blocks)
        if limits is not None or seq.limits is not None:
            if seq.limits is None:
                seq.limits = list(range(1, start + 1))
            seq.limits.extend(limits or range(start + 1, start + n + 1))
            seq.cacheable = False  # a page's keys depend on tokens after it, not just on those before
        if (parsed.embeds or parsed.extras or parsed.positions is not None or parsed.routing is not None
                or seq.positions is not None or seq.routing is not None):  # (a plain token call records nothing)
            self._append_inputs(seq, parsed, start)
        seq.chunkable = limits is None
        seq.tokens.extend(parsed.ids)
        seq.pending, seq.pending_start, seq.call = inv, start, parsed
        # each call's: the request's arrival, or its submission on a node with call_order "fifo" (a fork, a snapshot
        # or a moved cache made the sequence without one)
        seq.priority, seq.arrival = inv.priority, inv.arrival
        seq.collected, seq.stepped = [], []
        seq.gathers = self._wants_rows(parsed)
        seq.rows_from = self._rows_from(parsed, start) if seq.gathers else None
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

    def _run(self, work: list[tuple[Sequence, int]]) -> list[Result]:
        """Forward `work`, advance its sequences, and answer those whose input is now all computed."""
        try:
            hidden = self._forward(work)
        except Exception as exc:
            if self.ranks is not None:
                self._check_group(exc)  # a broken rank group ends this process (the server replaces the group)
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
        self.tokens_forwarded += sum(n for _, n in work)
        for seq, n in work:
            # rows before the call's first token are a recompute (after preemption), not the call's output
            lo = row + max(0, seq.pending_start - seq.num_computed)
            row += n
            seq.num_computed += n
            if not seq.readonly:
                self.blocks.commit(seq)
            if seq.gathers and lo < row and seq.call is not None:
                keep_all = seq.call.output_rows != "last" or seq.call.output_index is not None
                seq.collected.append(hidden[lo:row] if keep_all else hidden[row - 1 : row])
            if seq.remaining == 0:
                if seq.pending is not None:
                    done.append((seq, row - 1))
                else:
                    seq.recompute = False
        if not done:
            return []
        return self._finish(done, hidden) if self.samples else self._finish_rows(done)

