"""Checkpoint loading and writing: HF layout (safetensors, sharded, torch `weights_only`), GGUF, name mapping."""

from mstar_core.checkpoint.errors import CheckpointError, WeightMismatchError
from mstar_core.checkpoint.gguf import GGUFSource, gguf_llama_config, gguf_llama_mapping
from mstar_core.checkpoint.gguf_tokenizer import gguf_tokenizer
from mstar_core.checkpoint.hf import load_tokenizer, read_chat_template, read_config, read_eos_token_ids
from mstar_core.checkpoint.loader import build_and_load, load_weights
from mstar_core.checkpoint.mapping import ExpertFusion, RuleMapping, WeightMapping
from mstar_core.checkpoint.sources import SafetensorsSource, TensorSource, TorchFileSource, open_checkpoint
from mstar_core.checkpoint.writer import save_hf_checkpoint

__all__ = [
    "CheckpointError",
    "ExpertFusion",
    "GGUFSource",
    "RuleMapping",
    "SafetensorsSource",
    "TensorSource",
    "TorchFileSource",
    "WeightMapping",
    "WeightMismatchError",
    "build_and_load",
    "gguf_llama_config",
    "gguf_llama_mapping",
    "gguf_tokenizer",
    "load_tokenizer",
    "load_weights",
    "open_checkpoint",
    "read_chat_template",
    "read_config",
    "read_eos_token_ids",
    "save_hf_checkpoint",
]
