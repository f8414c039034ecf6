"""`KVCacheEngine` (kind `kvcache`): continuous batching of transformer calls over a paged KV pool."""

from __future__ import annotations

import time
from typing import Any

import torch

from mstar_core.errors import ConfigError, RequestError
from mstar_core.graph.options import check_call_options
from mstar_core.runtime.engine import Engine, EngineContext, Invocation, Result
from mstar_core.runtime.rank_steps import RankMessage
from mstar_kvcache.answers import CallAnswers
from mstar_kvcache.blocks import BlockManager
from mstar_kvcache.config import KVCacheSettings, kv_shape, select_backend
from mstar_kvcache.contract import BUILTIN_OUTPUTS, KVCacheModule, call_inputs, check_kvcache_module, samples
from mstar_kvcache.cross import CrossLabels
from mstar_kvcache.inputs import OPTIONS, ParsedInvocation
from mstar_kvcache.intake import CallIntake
from mstar_kvcache.labels import Labels
from mstar_kvcache.lora import NodeAdapters
from mstar_kvcache.no_token import NoTokenColumns
from mstar_kvcache.offload import host_tier
from mstar_kvcache.pool import PagePool
from mstar_kvcache.ranks import StepFollower, StepLeader, exit_if_broken, pool_class, split_shape
from mstar_kvcache.readers import ReadOnlyCalls
from mstar_kvcache.replay import StepReplay
from mstar_kvcache.rows import CallRows
from mstar_kvcache.scheduler import Scheduler
from mstar_kvcache.sequence import Sequence
from mstar_kvcache.sharing import cache_owner
from mstar_kvcache.snapshot import CacheSnapshot
from mstar_kvcache.speculative import Speculator
from mstar_kvcache.step_inputs import StepForward
from mstar_kvcache.transfer import CacheTransfer


class KVCacheEngine(Engine):
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

    This class holds the engine contract and one step's loop; it is composed of parts, each owning its state
    and given the parts it uses: the pool (`pool.py`), pages per sequence (`blocks.py`) and the host tier
    (`offload.py`); the policy that picks a step's rows (`scheduler.py`); the labels and their sequences
    (`labels.py`); calls attaching to their labels (`intake.py`) and read-only calls (`readers.py`); the forward
    of a step (`step_inputs.py`) and its replay (`replay.py`); the answers (`answers.py`, `rows.py`); moving
    caches between engines (`transfer.py`); and a node split across a rank group (`ranks.py`).
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
        kv_replicas = 1  # ranks holding each KV head (more than 1 where they outnumber the model's KV heads)
        if self.ranks is not None:
            model_kv_heads, kv_heads = kv_heads, split_shape(module, self.ranks, node.name, kv_heads)
            if not hasattr(module, "kv_cache_spec") and model_kv_heads < self.ranks.world_size:
                kv_replicas = self.ranks.world_size // model_kv_heads
        first = next(iter(module.parameters()), None) if hasattr(module, "parameters") else None
        self.dtype = dtype = torch.float32 if first is None else first.dtype
        self.samples = samples(node)
        axes = int(getattr(module, "position_axes", 1) or 1)
        inputs = {k: v for k, v in call_inputs(module, node.name).items() if k in node.all_inputs}
        self.share_with = node.options.get("share_cache_with")
        self.kv_shape = (layers, kv_heads, head_dim, dtype)
        # a reader of another node's labels uses that node's pool (see sharing.py); every other node owns its own
        self.partner = None if self.share_with is None else cache_owner(self, self.share_with, self.kv_shape)
        if self.partner is not None:
            self.pool: PagePool = self.partner.pool
        else:
            pages = self.settings.resolve_num_pages(layers, kv_heads, head_dim, dtype)
            self.pool = pool_class(self.ranks)(pages, self.settings.page_size, layers, kv_heads, head_dim, dtype,
                                               self.device)
        self.offload = host_tier(self.settings.kv_offload, self.pool, node.name, self.ranks, self.share_with)
        self.blocks = BlockManager(self.pool, self.settings.enable_prefix_caching, salt=node.name, host=self.offload)
        self.scheduler = Scheduler(self.blocks, self.settings.max_num_seqs, self.settings.max_num_batched_tokens,
                                   self.settings.background_step_tokens, self.settings.background_step_rows,
                                   self.settings.resolve_prefill_step_tokens(self.device))
        backend = select_backend(self.settings.attention_backend, self.device, context.registry)
        self.quantized_linears = 0
        if self.settings.quantize is not None and isinstance(module, torch.nn.Module):
            from mstar_core.nn.quant import check_mode, quantize_linears

            check_mode(self.settings.quantize, self.device, f"node '{node.name}': kvcache setting 'quantize'")
            self.quantized_linears = quantize_linears(module, self.settings.quantize)  # before packing: fewer left to pack
        self.packed_linears = 0
        if self.settings.pack_weights is not False and self.device.type == "cpu" and isinstance(module, torch.nn.Module):
            from mstar_core.nn.packed import pack_linears

            self.packed_linears = pack_linears(module)  # a CPU step's wide GEMMs stop repacking their weights
        forward_fn = module if not self.settings.compile else self._compiled(module)
        replay = None
        if self.settings.replay_steps is not False and not self.settings.compile and self.ranks is None:
            # a sampling node's replayed steps run the LM head too (every row of a lane step samples)
            replay = StepReplay.for_module(module, node.name, self.device, logits=self.samples)
        if self.settings.compile and self.ranks is not None and "routing" not in node.all_inputs:
            # a split node compiles every bucket now, while its worker loads: compiling mid-serving (tens of
            # seconds of Python) starved a loaded rank's heartbeats and its group was replaced. Every rank
            # builds its engines in the same order before it follows a step, so their collectives line up.
            embeds = "input_embeds" in node.all_inputs and self.hidden_size is not None
            forward_fn.warm_up(axes=axes, hidden=self.hidden_size if embeds else None, dtype=dtype)
        self.max_model_len = getattr(getattr(module, "config", None), "max_position_embeddings", None)
        self.grammar_vocab = getattr(module, "grammar_vocab", None)  # what sampling grammars compile against

        # the parts, each given the parts it uses
        leads = self.ranks is not None and self.ranks.leader
        self.leader = StepLeader(self.ranks, self.pool, node.name, kv_replicas) if leads else None
        if self.leader is not None:  # rank 0 runs the module's out-of-forward collectives on every rank
            self.module = self.leader.module_view(module)
        self.cross = CrossLabels(node.name, self.module, self.pool, self.device)  # encoder K/V labels (cross.py)
        self.forward = StepForward(self.module, forward_fn, backend, replay, self.pool, self.device, dtype, axes,
                                   "routing" in node.all_inputs, inputs, bool(self.settings.compile), self.leader,
                                   self.cross)
        self.follower = (StepFollower(self.ranks, self.pool, self.forward, self.module, self.device, node.name)
                         if self.ranks is not None and not leads else None)
        self.labels = Labels(node.name, self.blocks, self.forward, self.device)
        rows = CallRows(self.samples, [o for o in node.outputs if o not in BUILTIN_OUTPUTS])
        self.intake = CallIntake(node.name, self.vocab_size, self.hidden_size, axes, inputs, self.max_model_len,
                                 self.device, self.labels, rows, self.cross)
        source = self.labels if self.partner is None else self.partner.labels
        self.readonly = ReadOnlyCalls(node.name, self.share_with, self.labels, source, self.pool, self.device, axes,
                                      rows)
        no_token = NoTokenColumns.of(self.grammar_vocab, self.vocab_size, self.device)  # padding: never sampled
        self.answers = CallAnswers(node.name, self.module, node.outputs, rows, no_token, self.grammar_vocab,
                                   self.max_model_len, self.labels, self.readonly, self.intake, self.blocks)
        self.transfer = CacheTransfer(node.name, self.labels, self.pool, self.blocks, self.leader, self.device)
        # speculative decoding (speculative.py), where configured on a sampling node that runs on one process
        spec = self.settings.speculative
        self.speculator = (Speculator(spec, node.name, self.blocks, self.answers, self.max_model_len)
                           if spec is not None and self.samples and self.ranks is None else None)

        self.adapters: NodeAdapters | None = None  # LoRA adapters, once `enable_lora` ran (lora.py)

        self.num_preemptions = 0
        self.num_steps = 0
        self.tokens_forwarded = 0  # rows computed by forwards (prefill and decode; prefix-cache hits are not)
        self.largest_batch = 0  # most sequences (calls, labels) one forward has run so far

    @property
    def max_batch_size(self) -> int:
        return int(self.context.settings.get("max_batch_size", 4 * self.settings.max_num_seqs))

    def _compiled(self, module: Any) -> Any:
        from mstar_kvcache.compiled import CompiledForward, default_buckets

        buckets = self.settings.compile_buckets or default_buckets(self.settings.max_num_batched_tokens)
        return CompiledForward(module, self.device, buckets, cuda_graphs=self.settings.cuda_graphs, node=self.node.name,
                               split=self.ranks is not None)

    # -- what the parts hold, as tests, tools and a sharing node read it ----------------------------

    @property
    def seqs(self) -> dict[tuple[str, str], Sequence]:
        return self.labels.seqs

    @property
    def readers(self) -> list[Sequence]:
        return self.readonly.attached

    @property
    def waiting_readers(self) -> list[tuple[Invocation, ParsedInvocation]]:
        return self.readonly.waiting

    @property
    def backend(self) -> Any:
        return self.forward.backend

    @backend.setter
    def backend(self, backend: Any) -> None:  # (a test runs the engine on another backend)
        self.forward.backend = backend

    @property
    def forward_fn(self) -> Any:
        return self.forward.forward_fn

    @forward_fn.setter
    def forward_fn(self, forward_fn: Any) -> None:  # (a test wraps the forward to fail it)
        self.forward.forward_fn = forward_fn

    @property
    def replay(self) -> StepReplay | None:
        return self.forward.replay

    @property
    def no_token(self) -> NoTokenColumns | None:
        return self.answers.no_token

    # -- contract ---------------------------------------------------------------------------------

    def add(self, invocation: Invocation) -> None:
        transfer = invocation.options.get("transfer")
        if transfer is not None:
            self._settle(invocation.request_id)
            # (an export releases the request, which rebuilds the answered list: append after it)
            answer = self.transfer.answer(invocation, transfer, self.release)
            self.intake.answered.append((invocation, answer))
            return
        # whatever this invocation's inputs trigger here (parsing, seeding, attaching) answers it alone
        try:
            parsed = self.intake.parse(invocation)
            if not parsed.write_cache:
                self.readonly.waiting.append((invocation, parsed))
                return
            if self.speculator is not None and parsed.fork_from is not None:
                self.speculator.settle(self.labels.seqs.get((invocation.request_id, parsed.fork_from)))
            if parsed.cross_states is not None:  # stored (batched) at the next step, then attached
                self.cross.queue(invocation, parsed)
                return
        except Exception as exc:
            self.intake.answered.append((invocation, exc))
            return
        self._attach(invocation, parsed)

    def _attach(self, invocation: Invocation, parsed: ParsedInvocation) -> None:
        try:
            seq = self.labels.sequence(invocation, parsed)
        except Exception as exc:
            self.intake.answered.append((invocation, exc))
            return
        if self.speculator is not None:  # a token verified ahead answers a decode call without a forward
            ahead = self.speculator.answer_ahead(seq, invocation, parsed)
            if ahead is not None:
                self.intake.answered.append((invocation, ahead))
                return
        if seq.pending is not None:
            self.intake.backlog.append(invocation)
            return
        try:
            self.intake.attach(seq, invocation, parsed)
        except Exception as exc:
            self.intake.answered.append((invocation, exc))

    def has_work(self) -> bool:
        return (bool(self.intake.answered) or bool(self.readonly.waiting) or bool(self.readonly.attached)
                or bool(self.cross.waiting)
                or any(s.pending is not None or s.recompute for s in self.labels.seqs.values()))

    def step(self) -> list[Result]:
        if self.cross.waiting:
            ready, failed = self.cross.store_waiting()
            self.intake.answered.extend(failed)
            for invocation, parsed in ready:
                self._attach(invocation, parsed)
        if self.readonly.waiting:
            self.intake.answered.extend(self.readonly.attach_waiting())
        results = self.intake.take_answered()
        seqs = self.labels.seqs
        pending = [s for s in seqs.values() if s.pending is not None or s.recompute]
        pending.extend(self.readonly.attached)
        if not pending:
            return results
        if self.speculator is not None:
            self.speculator.propose(pending)
        plan = self.scheduler.schedule(pending, seqs.values)
        if self.speculator is not None:
            self.speculator.trim(plan.work, pending)
        if self.offload is not None:
            self.offload.load(plan.work)  # restored sequences get their keys and values back before the forward
        self.num_preemptions += len(plan.preempted)
        for seq in plan.preempted:  # recomputed from its first token: its call's rows are gathered again
            if seq.host is None:  # (an offloaded one continues where it stopped, rows gathered so far kept)
                seq.collected = []
        for seq in plan.too_large:
            need = self.blocks.total_pages(seq)
            results.append(self.answers.fail(seq, RequestError(
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

    def answers_only(self) -> bool:
        # tokens verified ahead by speculative decoding answer decode calls with no forward: the scheduler returns
        # them from the event loop (checked only while there are such answers: the scan is over the labels)
        return (bool(self.intake.answered) and not self.readonly.waiting and not self.readonly.attached
                and not self.cross.waiting and not any(s.pending is not None or s.recompute for s in self.labels.seqs.values()))

    def release(self, request_id: str) -> None:
        forgotten = self.labels.release(request_id)
        if self.leader is not None:  # its followers forget them with the next step
            self.leader.forgotten.extend(forgotten)
        self.readonly.release(request_id)
        self.intake.release(request_id)
        self.cross.release(request_id)

    def active_requests(self) -> set[str]:
        return ({k[0] for k in self.labels.seqs} | self.intake.request_ids() | self.readonly.request_ids()
                | {k[0] for k in self.cross.labels} | self.cross.request_ids())

    def stats(self) -> dict[str, float]:
        pending = [s for s in self.labels.seqs.values() if s.pending is not None]
        replay = self.forward.replay
        return {
            "kv_pages_total": self.pool.num_pages,
            "kv_pages_used": self.pool.num_used,
            "kv_pages_cached": self.pool.num_cached,
            "kv_cross_pages": self.cross.num_pages,
            "kv_page_copies": self.pool.copies,
            "kv_prefix_hit_pages": self.pool.hits,
            "kv_prefix_partial_hits": self.pool.partial_hits,
            "tokens_forwarded": self.tokens_forwarded,
            "num_preemptions": self.num_preemptions,
            "largest_batch": self.largest_batch,
            "packed_linears": self.packed_linears,
            **({"replayed_steps": replay.replayed, "recorded_steps": replay.recorded} if replay is not None else {}),
            "quantized_linears": self.quantized_linears,
            "num_running": sum(1 for s in pending if s.pages) + len(self.readonly.attached),
            "num_waiting": sum(1 for s in pending if not s.pages) + len(self.readonly.waiting),
            **({"compile_seconds": self.forward.forward_fn.compile_seconds} if self.settings.compile else {}),
            **(self.offload.stats() if self.offload is not None else {}),
            **(self.speculator.stats() if self.speculator is not None else {}),
            **(self.adapters.stats() if self.adapters is not None else {}),
            # this process's share of the KV pool (a split node's pool holds only its rank's heads)
            "kv_heads": self.kv_shape[1],
            "kv_pool_bytes": self.pool.kv.numel() * self.pool.kv.element_size(),
            **({"tensor_parallel_rank": self.ranks.rank, "tensor_parallel_size": self.ranks.world_size}
               if self.ranks is not None else {}),
        }

    def close(self) -> None:
        self.labels.close()
        self.readonly.close()
        self.cross.close()

    # -- LoRA adapters (lora.py; the runtime calls these on the device thread, between steps) --------

    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        """Hold up to `max_loras` adapters of rank up to `max_rank` (calls then name one with input `lora`)."""
        if self.adapters is not None:
            if (self.adapters.max_loras, self.adapters.max_rank) != (max_loras, max_rank):
                raise ConfigError(f"node '{self.node.name}': LoRA already enabled with max_loras "
                                  f"{self.adapters.max_loras}, max_lora_rank {self.adapters.max_rank}")
            return
        if self.ranks is not None:
            raise ConfigError(f"node '{self.node.name}': LoRA adapters on a node split across ranks "
                              "(tensor_parallel) are not supported; serve it on one device")
        if self.quantized_linears:
            raise ConfigError(f"node '{self.node.name}': LoRA adapters over quantized linears are not supported; "
                              "drop the node's 'quantize' setting")
        seqs = lambda: [*self.labels.seqs.values(), *self.readonly.attached]  # noqa: E731
        self.adapters = NodeAdapters(self.node.name, self.module, max_loras, max_rank, seqs)
        self.intake.adapters = self.forward.adapters = self.adapters

    def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter directory `path` as `name` (`enable_lora` first)."""
        if self.adapters is None:
            raise ConfigError(f"node '{self.node.name}': LoRA adapters are not enabled (set max_loras)")
        self.adapters.load(name, path)

    def unload_lora(self, name: str) -> None:
        """Free adapter `name` (refused while a sequence runs under it)."""
        if self.adapters is None:
            raise RequestError(f"node '{self.node.name}': no LoRA adapter named '{name}' is loaded", status=404)
        self.adapters.unload(name)

    # -- cache labels and moved caches (walks' label operations, per-walk placement) ---------------

    def fork(self, request_id: str, src_label: str, dst_label: str) -> None:
        """Share `src_label`'s cache under `dst_label` copy-on-write (see `Labels.fork`)."""
        self._settle(request_id)
        self.labels.fork(request_id, src_label, dst_label)

    def drop_label(self, request_id: str, label: str) -> None:
        """Forget one cache label of a request (its pages return to the pool unless shared)."""
        self.labels.drop_label(request_id, label)

    def snapshot_label(self, request_id: str, src_label: str, dst_label: str) -> None:
        """Make `dst_label` a copy-on-write copy of `src_label` as it stands (replacing `dst_label`)."""
        self._settle(request_id)
        self.labels.snapshot_label(request_id, src_label, dst_label)

    def export_cache(self, request_id: str, label: str = "main") -> CacheSnapshot:
        """A copy of one label's cache and sampling state, for `import_cache` in another engine."""
        self._settle(request_id)
        return self.transfer.export_cache(request_id, label)

    def import_cache(self, request_id: str, snapshot: CacheSnapshot) -> None:
        """Make `snapshot` this request's cache label, as if its tokens had been computed here."""
        self.transfer.import_cache(request_id, snapshot)

    def _settle(self, request_id: str) -> None:
        """Before a label operation: drop the request's verified tokens no call has taken (speculative.py)."""
        if self.speculator is not None:
            for key, seq in self.labels.seqs.items():
                if key[0] == request_id:
                    self.speculator.settle(seq)

    def follow(self, msg: RankMessage) -> None:
        """A split node's follower rank: run what rank 0 sent (on the device thread, in the order it came)."""
        if self.follower is None:
            raise RuntimeError(f"node '{self.node.name}': only a follower rank of a split node follows steps")
        self.follower.follow(msg)

    # -- one step ---------------------------------------------------------------------------------

    def _run(self, work: list[tuple[Sequence, int]]) -> list[Result]:
        """Forward `work`, advance its sequences, and answer those whose input is now all computed."""
        # (a replayed step then hands out its hidden rows as they lie, and picks greedy rows' tokens with its head)
        later = self.answers.reads_hidden_later(work)
        self.forward.expect(keep=later, greedy=self.samples and self.answers.takes_argmax(work),
                            rows=None if later else self.answers.rows_read(work))
        try:
            hidden = self.forward.run(work)
        except Exception as exc:
            if self.ranks is not None:  # a broken rank group ends this process (the server replaces the group)
                exit_if_broken(exc, self.node.name, self.ranks)
            if len(work) == 1:
                if self.speculator is not None:
                    self.speculator.drop_drafts(work[0][0])
                if work[0][0].pending is None:  # a recompute for readers: they keep waiting
                    work[0][0].recompute = False
                    return []
                return [self.answers.fail(work[0][0], exc)]
            # One sequence's input may be what breaks the batch: run each alone so only the culprit
            # fails. Nothing advanced, so a retry just rewrites the same positions' KV.
            return [r for item in work for r in self._run([item])]
        done: list[tuple[Sequence, int]] = []
        guessed: list[tuple[Sequence, int, int]] = []  # sequences that ran guesses: verified below
        row = 0
        self.tokens_forwarded += sum(n for _, n in work)
        for seq, n in work:
            if seq.speculation is not None and seq.speculation.drafts:
                guessed.append((seq, row, n))
                row += n
                continue
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
        verified = self.speculator.verify(guessed, hidden) if guessed else []
        if not done:
            return verified
        if not self.samples:
            return verified + self.answers.finish_rows(done)
        return verified + self.answers.finish(done, hidden, self.forward.logits, self.forward.tokens)
