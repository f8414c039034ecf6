"""M* model package for Llama-family causal LMs: `ModelSpec("llama")` with presets `tiny` and `smollm2`."""

from mstar_llm.model import SPEC, load_llm

__all__ = ["SPEC", "load_llm"]
