"""Compiled steps: a node's forward through `torch.compile`, one static graph per token-count bucket.

The paged attention context is host logic (page tables, lanes, per-sequence prefill loops), so it
stays eager: inside the compiled graph, attention is one opaque op (`mstar_kvcache::attend`) that
hands q/k/v to the step's real context, kept in a thread-local slot while the step runs. Everything
around it (embeddings, RoPE, norms, the fused projections, MLPs, the final norm) is one graph.

A step's token count is padded up to a bucket (`compile_buckets`, default powers of two up to the
token budget), so a running batch whose size moves by one does not recompile: each bucket compiles
once. Padded rows run through the dense layers and get zeros from attention; they are cut off
before anyone sees them. Steps larger than the largest bucket, and steps with per-call module
tensors (whose shapes depend on the number of sequences), run eager.

A node split across ranks (`split`) compiles the same way on every rank: each rank pads a step to
the same bucket and runs the same graph, whose collectives (row-parallel sums, the vocabulary-parallel
embedding's) are opaque ops too (`mstar_core.nn.parallel.collectives`). A rank whose compile fails runs
that graph's function eager, still padded, so its collectives keep the shapes of the ranks that did compile.
Its engine compiles every bucket while it loads (`warm_up`), see engine.py.

On CUDA the compiled graphs are also captured as CUDA graphs (inductor's cudagraph trees with
graph partitions: the attention op is marked cudagraph-unsafe, so the pieces between attention
calls are replayed as graphs and attention runs eagerly between them, as vLLM's piecewise graphs
do). On CPU inductor needs a C++ compiler; without one the node runs eager, with one warning.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger("mstar.kvcache.compiled")

_slot = threading.local()  # the running step's attention context and real token count


def _tags() -> tuple:
    tag = getattr(torch.Tag, "cudagraph_unsafe", None)
    return (tag,) if tag is not None else ()


@torch.library.custom_op("mstar_kvcache::attend", mutates_args=(), tags=_tags())
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """The real context attends over the step's real rows; padded rows get zeros."""
    context, tokens = _slot.context, _slot.tokens
    try:
        out = context.attend(layer, q[:tokens], k[:tokens], v[:tokens], scale)
    except Exception:
        _slot.context_failed = True  # the step's inputs, not the compiler: CompiledForward re-raises it
        raise
    if tokens == q.shape[0]:
        return out.contiguous()
    padded = q.new_zeros(q.shape)
    padded[:tokens] = out
    return padded


@_attend.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    return torch.empty_like(q)


class _OpaqueContext:
    """What the compiled graph sees as its attention context: every call becomes the opaque op."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.ops.mstar_kvcache.attend(q, k, v, layer, scale)


_OPAQUE = _OpaqueContext()


def default_buckets(max_tokens: int) -> list[int]:
    """Powers of two up to (and including) the first one that covers `max_tokens`."""
    buckets, b = [], 1
    while True:
        buckets.append(b)
        if b >= max_tokens:
            return buckets
        b *= 2


def compiler_missing(device: torch.device) -> str | None:
    """Why inductor cannot compile for `device` here, or None when it can."""
    if device.type == "cpu":
        cxx = os.environ.get("CXX")
        if cxx and shutil.which(cxx):
            return None
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
            return None
        except Exception:  # inductor raises its own types; any failure means no usable compiler
            if any(shutil.which(c) for c in ("g++", "c++", "clang++")):
                return None
            return "no C++ compiler found (inductor's CPU backend needs one: install g++ or set CXX)"
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed (inductor's CUDA backend needs it)"
    return None


class CompiledForward:
    """Calls `module(ids, positions, context, input_embeds=...)` through per-bucket compiled graphs.

    `cuda_graphs` (CUDA only) captures the compiled pieces as CUDA graphs. `compile_seconds` and
    `compiled_buckets` say what compiling has cost so far.
    """

    def __init__(
        self,
        module: Any,
        device: torch.device,
        buckets: Sequence[int],
        *,
        cuda_graphs: bool | None = None,
        node: str = "?",
        split: bool = False,
    ):
        self.module, self.device = module, torch.device(device)
        self.buckets = sorted(set(int(b) for b in buckets))
        self.node, self.split = node, split
        self._padded_eager = False  # a split node's fallback: the step function eager, on padded inputs
        self.compile_seconds = 0.0
        self.compiled_buckets: set[int] = set()
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self._variants: set[tuple[int, bool]] = set()
        self.eager_reason = compiler_missing(self.device)
        if self.eager_reason is not None:
            warnings.warn(f"kvcache node '{node}': compile is on but {self.eager_reason}; running eager",
                          RuntimeWarning, stacklevel=2)
            self._compiled = None
            self.cuda_graphs = False
            return
        options: dict[str, Any] = {}
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else cuda_graphs and self.device.type == "cuda"
        if self.cuda_graphs:
            options = {"triton.cudagraphs": True, "graph_partition": True}
        # one static graph per bucket: allow that many entries for the step function
        limit = len(self.buckets) + 4
        for key in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, key):
                setattr(torch._dynamo.config, key, max(getattr(torch._dynamo.config, key), limit))
        self._compiled = torch.compile(self._step, dynamic=False, fullgraph=False, options=options or None)

    def _step(self, ids: torch.Tensor | None, positions: torch.Tensor, embeds: torch.Tensor | None) -> torch.Tensor:
        if embeds is None:
            return self.module(ids, positions, _OPAQUE)
        return self.module(None, positions, _OPAQUE, input_embeds=embeds)

    def _stage(self, name: str, tensor: torch.Tensor, size: int) -> torch.Tensor:
        """`tensor` (tokens on its last dim for positions, first dim otherwise) copied into the bucket's zero-padded buffer."""
        last = name == "positions"
        shape = (*tensor.shape[:-1], size) if last else (size, *tensor.shape[1:])
        key = (name, size)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != tensor.dtype or buf.device != tensor.device:
            buf = self._buffers[key] = torch.zeros(shape, dtype=tensor.dtype, device=tensor.device)
        tokens = tensor.shape[-1] if last else tensor.shape[0]
        if last:
            buf[..., :tokens].copy_(tensor)
            buf[..., tokens:].zero_()
        else:
            buf[:tokens].copy_(tensor)
            buf[tokens:].zero_()
        return buf

    def bucket(self, tokens: int) -> int | None:
        """The smallest bucket holding `tokens`, or None (run eager)."""
        return next((b for b in self.buckets if b >= tokens), None)

    def __call__(
        self,
        ids: torch.Tensor | None,
        positions: torch.Tensor,
        context: Any,
        input_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        tokens = positions.shape[-1]
        size = None if self._compiled is None or kwargs else self.bucket(tokens)
        if size is None:
            if input_embeds is None:
                return self.module(ids, positions, context, **kwargs)
            return self.module(None, positions, context, input_embeds=input_embeds, **kwargs)
        # inputs go into one fixed buffer per bucket: the same kind of tensor every call (an inference
        # tensor here, a plain one there would fail dynamo's guards and compile again), and static
        # addresses for CUDA graphs
        with torch.inference_mode():
            positions = self._stage("positions", positions, size)
            if input_embeds is None:
                ids = self._stage("ids", ids, size)
            else:
                input_embeds = self._stage("embeds", input_embeds, size)
        _slot.context, _slot.tokens, _slot.context_failed = context, tokens, False
        variant = (size, input_embeds is None)  # ids and embeddings are two graphs of one bucket
        first = variant not in self._variants
        start = time.perf_counter()
        try:
            if self.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()  # each step is a new iteration of the graph tree
            hidden = self._compiled(None if input_embeds is not None else ids, positions, input_embeds)
        except Exception as exc:
            if not first or _slot.context_failed or self._padded_eager:
                raise
            # compiling (or running the compiled graph) failed, not the attention context: serve eager
            # from now on; KV rows this attempt may have written are rewritten by the eager run
            warnings.warn(f"kvcache node '{self.node}': compiling the {size}-token step failed "
                          f"({type(exc).__name__}: {str(exc)[:200]}); running eager", RuntimeWarning, stacklevel=2)
            self._compiled, self.eager_reason = None, f"compile failed: {type(exc).__name__}"
            self.cuda_graphs = False
            _slot.context = None
            if self.split:  # other ranks may run their compiled graphs: keep the padded shapes they all-reduce
                self._compiled, self._padded_eager = self._step, True
            real = ids[:tokens] if input_embeds is None else None
            embeds = None if input_embeds is None else input_embeds[:tokens]
            return self(real, positions[..., :tokens], context, input_embeds=embeds)
        finally:
            _slot.context = None
        if first:
            self._variants.add(variant)
        if first and not self._padded_eager:
            self.compiled_buckets.add(size)
            took = time.perf_counter() - start
            self.compile_seconds += took
            log.info("kvcache node '%s': compiled the %d-token bucket in %.1f s", self.node, size, took)
        # a CUDA graph's output buffer is overwritten by its next replay: hand out a copy
        return hidden[:tokens].clone() if self.cuda_graphs else hidden[:tokens]

    def warm_up(self, sizes: Sequence[int] | None = None, *, axes: int = 1, hidden: int | None = None,
                dtype: torch.dtype | None = None) -> float:
        """Compile the given buckets (default all) ahead of traffic with a dense no-cache context; returns seconds.

        `axes` is the module's position axes (positions `[axes, T]` when above 1, as the engine passes them); with
        `hidden` each bucket's embeddings graph (`input_embeds` of `[T, hidden]` in `dtype`) compiles too.
        """
        if self._compiled is None:
            return 0.0
        from mstar_core.nn.attention import DenseAttention

        start = time.perf_counter()
        with torch.inference_mode():
            for size in sizes or self.buckets:
                positions = torch.arange(size, device=self.device)
                if axes > 1:
                    positions = positions.expand(axes, -1)
                self(torch.zeros(size, dtype=torch.long, device=self.device), positions, DenseAttention())
                if hidden is not None:
                    embeds = torch.zeros(size, hidden, dtype=dtype, device=self.device)
                    self(None, positions, DenseAttention(), input_embeds=embeds)
        return time.perf_counter() - start
