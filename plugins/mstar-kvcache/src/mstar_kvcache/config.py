"""Engine settings (strict: unknown keys are errors), the model's KV shape, and attention-backend choice."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from mstar_core.errors import ConfigError
from mstar_core.strict import reject_unknown
from mstar_kvcache.pool import PagePool
from mstar_kvcache.speculative import SpeculativeSettings

# with neither `num_pages` nor `kv_cache_bytes`, the pool holds `max_num_seqs` sequences of DEFAULT_TOKENS_PER_SEQ
# tokens (at least DEFAULT_NUM_PAGES pages) within DEFAULT_KV_CACHE_BYTES, vLLM's default CPU KV space: a fixed
# page count sized for a tiny model preempted a real one's c=32 load (32 x 330 tokens > 512 x 16)
DEFAULT_NUM_PAGES = 512
DEFAULT_TOKENS_PER_SEQ = 1024
DEFAULT_KV_CACHE_BYTES = 4 << 30
OFFLOAD_RULES = ("auto", "always", "never")
# prompt tokens a step with decode rows takes on a CPU node by default: a 512-token chunk beside 32 decode rows made
# every stream's token wait ~0.7 s on a 2-core CPU (SmolLM2-135M fp32); 256 halves that at the same tokens/s. (Other
# devices keep the whole budget: their steps' time grows far less with a chunk, and nothing was measured there.)
CPU_PREFILL_STEP_TOKENS = 256


@attrs.frozen(kw_only=True)
class OffloadSettings:
    """`kv_offload`: a host tier of `host_pages` pages (see offload.py).

    A preempted sequence with at least `min_tokens` computed tokens moves its pages there (`rule`:
    `auto` only where the copy is estimated cheaper than recomputing, `always`, or `never`); with
    `spill_prefixes` prefix-cache pages the device pool evicts go there too.
    """

    host_pages: int
    min_tokens: int = 0
    rule: str = "auto"
    spill_prefixes: bool = False

    @classmethod
    def from_mapping(cls, values: Any) -> OffloadSettings:
        where = "kvcache engine: setting 'kv_offload'"
        if not isinstance(values, Mapping):
            raise ConfigError(f"{where} must be a mapping like {{host_pages: 256}}, got {values!r}")
        reject_unknown(values, (f.name for f in attrs.fields(cls)), "kvcache engine", what="setting",
                       shown=lambda k: f"kv_offload.{k}")
        if "host_pages" not in values:
            raise ConfigError("kvcache engine: setting 'kv_offload.host_pages' is required (host pages to hold)")
        for key, least in (("host_pages", 1), ("min_tokens", 0)):
            value = values.get(key, least)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"kvcache engine: setting 'kv_offload.{key}' must be an integer >= {least}, "
                                  f"got {value!r}")
        if values.get("rule", "auto") not in OFFLOAD_RULES:
            raise ConfigError(f"kvcache engine: setting 'kv_offload.rule' must be one of {list(OFFLOAD_RULES)}, "
                              f"got {values['rule']!r}")
        if not isinstance(values.get("spill_prefixes", False), bool):
            raise ConfigError(f"kvcache engine: setting 'kv_offload.spill_prefixes' must be true or false, "
                              f"got {values['spill_prefixes']!r}")
        return cls(**values)


@attrs.frozen(kw_only=True)
class KVCacheSettings:
    """`num_pages` (or `kv_cache_bytes`, a memory budget) pages of `page_size` tokens; batching limits."""

    num_pages: int | None = None
    kv_cache_bytes: int | None = None
    page_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # tokens background sequences (Batch API lines) may add to a step live sequences have work in (scheduler.py)
    background_step_tokens: int = 8
    # background sequences that may share a step live sequences have work in (scheduler.py)
    background_step_rows: int = 1
    # prompt tokens a step may take while it carries decode rows (scheduler.py); None: CPU_PREFILL_STEP_TOKENS on a
    # CPU node, the whole token budget elsewhere (a value >= max_num_batched_tokens is the whole budget anywhere)
    prefill_step_tokens: int | None = None
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    max_batch_size: int | None = None
    # compiled steps (see compiled.py): off by default; buckets default to powers of two up to the token budget
    compile: bool = False
    compile_buckets: tuple[int, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(tuple))
    cuda_graphs: bool | None = None  # None: on when compiling on CUDA
    # every fp32 (and, where oneDNN runs it, bf16) linear prepacked for oneDNN at load (mstar_core/nn/packed.py); None: on for a CPU node
    pack_weights: bool | None = None
    # the node's linears quantized at load (mstar_core/nn/quant.py): int8 / int8_dynamic / int8_token (CPU), fp8 (CUDA); None: off
    quantize: str | None = None
    # a host tier for preempted sequences' pages and evicted prefix pages (offload.py); None: off
    kv_offload: OffloadSettings | None = None
    # decode steps recorded once per batch layout and replayed from C (replay.py); None: on for a CPU node
    replay_steps: bool | None = None
    # speculative decoding (speculative.py): {method: ngram, num_tokens, max_ngram, min_ngram, max_batch}; None: off
    speculative: SpeculativeSettings | None = None

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> KVCacheSettings:
        reject_unknown(values, (f.name for f in attrs.fields(cls)), "kvcache engine", what="setting")
        for key in ("num_pages", "kv_cache_bytes", "page_size", "max_num_seqs", "max_num_batched_tokens",
                    "background_step_tokens", "background_step_rows", "prefill_step_tokens"):
            value = values.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"kvcache engine: setting '{key}' must be a positive integer, got {value!r}")
        for key in ("compile", "cuda_graphs", "pack_weights", "replay_steps"):
            if values.get(key) is not None and not isinstance(values[key], bool):
                raise ConfigError(f"kvcache engine: setting '{key}' must be true or false, got {values[key]!r}")
        if values.get("quantize") is not None:
            from mstar_core.nn.quant import QUANT_MODES

            if values["quantize"] not in QUANT_MODES:
                raise ConfigError(f"kvcache engine: setting 'quantize' must be one of {list(QUANT_MODES)} (or absent), "
                                  f"got {values['quantize']!r}")
        buckets = values.get("compile_buckets")
        if buckets is not None and (
            not isinstance(buckets, (list, tuple)) or not buckets
            or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets)
        ):
            raise ConfigError(f"kvcache engine: setting 'compile_buckets' must be a list of positive integers, got {buckets!r}")
        if values.get("num_pages") is not None and values.get("kv_cache_bytes") is not None:
            raise ConfigError("kvcache engine: give either 'num_pages' or 'kv_cache_bytes', not both")
        if values.get("kv_offload") is not None:
            values = {**values, "kv_offload": OffloadSettings.from_mapping(values["kv_offload"])}
        if values.get("speculative") is not None:
            values = {**values, "speculative": SpeculativeSettings.from_mapping(values["speculative"])}
        return cls(**values)

    def resolve_prefill_step_tokens(self, device: torch.device) -> int | None:
        """The scheduler's cap on a step's prompt tokens beside decode rows (None: none) on `device`."""
        if self.prefill_step_tokens is not None:
            return self.prefill_step_tokens
        return CPU_PREFILL_STEP_TOKENS if device.type == "cpu" else None

    def resolve_num_pages(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Pages to preallocate: explicit, from the memory budget, or the default (see DEFAULT_TOKENS_PER_SEQ)."""
        if self.num_pages is not None:
            return self.num_pages
        per_page = PagePool.bytes_per_page(self.page_size, layers, kv_heads, head_dim, dtype)
        if self.kv_cache_bytes is not None:
            pages = self.kv_cache_bytes // per_page
            if pages < 1:
                raise ConfigError(
                    f"kvcache engine: kv_cache_bytes={self.kv_cache_bytes} is less than one page ({per_page} bytes)"
                )
            return pages
        wanted = max(DEFAULT_NUM_PAGES, self.max_num_seqs * -(-DEFAULT_TOKENS_PER_SEQ // self.page_size))
        return max(1, min(wanted, DEFAULT_KV_CACHE_BYTES // per_page))


def kv_shape(module: Any) -> tuple[int, int, int, int, int | None]:
    """`(layers, kv_heads, head_dim, vocab_size, hidden_size)` from `module.kv_cache_spec()` or its HF-style config."""
    if hasattr(module, "kv_cache_spec"):
        return tuple(module.kv_cache_spec())  # type: ignore[return-value]
    cfg = getattr(module, "config", None)
    if cfg is None:
        raise ConfigError(
            f"kvcache engine: module {type(module).__name__} has no `config` (num_hidden_layers, num_key_value_heads, "
            "head_dim, vocab_size) and no kv_cache_spec(); give it one of them"
        )
    get = cfg.get if isinstance(cfg, Mapping) else lambda k, d=None: getattr(cfg, k, d)
    heads = get("num_attention_heads")
    hidden = get("hidden_size")
    head_dim = get("head_dim") or hidden // heads
    return (get("num_hidden_layers"), get("num_key_value_heads") or heads, head_dim, get("vocab_size"), hidden)


def select_backend(name: str, device: torch.device, registry: Any) -> Any:
    """Instantiate the named attention backend, looked up in the plugin registry (the process's when None).

    "auto" = flashinfer on CUDA when it is registered and available there, else torch.
    """
    if registry is None:
        from mstar_core.plugins.manager import default_registry

        registry = default_registry()
    backends = registry.attention_backends

    def lookup(key: str) -> Any:
        if key in backends:
            return backends.get(key)
        known = ", ".join(backends) or "none"
        raise ConfigError(f"kvcache engine: unknown attention_backend '{key}'; registered: {known} (install the "
                          "plugin that registers it, e.g. mstar-attn-torch, or check MSTAR_PLUGINS)")

    if name == "auto":
        name = "torch"
        if device.type == "cuda" and "flashinfer" in backends and backends.get("flashinfer").available(device):
            name = "flashinfer"
    cls = lookup(name)
    if not cls.available(device):
        raise ConfigError(f"kvcache engine: attention backend '{name}' cannot run on {device}; use 'torch'")
    return cls(device)
