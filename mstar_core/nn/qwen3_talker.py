"""What Qwen3-Omni's Talker and Qwen3-TTS's Talker share: their decoder's config, the config they have in common
(codec ids, code predictor, code-0 suppression) and the module around the decoder (codec table and head).

The two differ where the models do: Omni's Talker decoder is MoE with a shared expert and reads its sizes from a
`text_config` section, and it is fed by projections of the Thinker's rows; TTS's is dense, its sizes sit flat
in `talker_config` beside the codec ids, and it embeds and projects text itself. The subclasses in the model
packages hold those parts. Checkpoint names: `talker.model.{layers, norm, codec_embedding}`,
`talker.{codec_head, code_predictor}` and the subclass's projections.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import torch
from torch import nn

from mstar_core.config.hf import check, head_dim_from_heads, read_fields, rope_settings, section
from mstar_core.errors import ConfigError
from mstar_core.nn.attention import AttentionContext
from mstar_core.nn.code_predictor import CodePredictor, CodePredictorConfig, Qwen3DecoderSizes
from mstar_core.nn.qwen3_decoder import Qwen3Decoder


@attrs.frozen(kw_only=True)
class Qwen3TextConfig(Qwen3DecoderSizes):
    """A Qwen3 decoder's sizes (`mstar_core.nn.qwen3_decoder`): MoE (the Omni Thinker's text model, its Talker's
    with a shared expert) or dense (`num_experts` 0: the TTS Talker's). The expert defaults are the Omni
    Thinker's; each model passes its published widths to `from_hf` as `defaults`."""

    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    mrope_section: tuple[int, ...] = (24, 20, 20)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any] | None, where: str, *, default_theta: float,
                defaults: Mapping[str, Any], **fixed: Any) -> Qwen3TextConfig:
        """The section at dotted key `where`: `defaults` replace the class's for absent keys (a model's published
        sizes), `fixed` fields are not read at all (what the model's architecture settles)."""
        cfg = section(cfg, where)
        rope = rope_settings(cfg, where, default_theta)
        text = read_fields(cls, cfg, where, defaults={"head_dim": head_dim_from_heads, **defaults},
                           rope_theta=rope["rope_theta"],
                           mrope_section=check(rope.get("mrope_section", (24, 20, 20)), tuple[int, ...],
                                               f"{where}.rope_scaling.mrope_section", example=(24, 20, 20)),
                           **fixed)
        if 2 * sum(text.mrope_section) != text.head_dim:
            raise ConfigError(f"config.json: '{where}' mrope_section {list(text.mrope_section)} must add up to "
                              f"head_dim / 2 = {text.head_dim // 2}")
        if text.num_attention_heads % text.num_key_value_heads:
            raise ConfigError(f"config.json: '{where}.num_attention_heads' must be a multiple of num_key_value_heads")
        return text

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0


@attrs.frozen(kw_only=True)
class Qwen3TalkerConfig:
    """The `talker_config` keys both Talkers read (published defaults); a model's subclass adds its own."""

    CODEC_ID_KEYS: ClassVar[tuple[str, ...]] = ("codec_eos_token_id", "codec_nothink_id", "codec_think_bos_id",
                                                "codec_think_eos_id", "codec_pad_id", "codec_bos_id")

    text: Qwen3TextConfig
    predictor: CodePredictorConfig
    num_code_groups: int = 16
    codec_eos_token_id: int = 2150
    codec_nothink_id: int = 2155
    codec_think_bos_id: int = 2156
    codec_think_eos_id: int = 2157
    codec_pad_id: int = 2148
    codec_bos_id: int = 2149
    # ids at or above this are never sampled as code 0 (but EOS); -1: the published rule, the top 1024 ids
    suppress_from: int = -1

    @classmethod
    def read(cls, cfg: Mapping[str, Any], where: str, text: Qwen3TextConfig, **extra: Any) -> Any:
        """`cls` from section `cfg` at `where` with its decoder `text` and the subclass's `extra` fields; the code
        predictor, the codec ids and the group count checked."""
        predictor = CodePredictorConfig.from_hf(cfg.get("code_predictor_config"), f"{where}.code_predictor_config")
        talker = read_fields(cls, cfg, where, text=text, predictor=predictor, **extra)
        if talker.suppress_from < 0:
            talker = attrs.evolve(talker, suppress_from=max(0, text.vocab_size - 1024))
        vocab = text.vocab_size
        bad = [f"{k}={v}" for k, v in talker.codec_ids().items()
               if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab]
        if bad:
            raise ConfigError(f"config.json: {where} codec ids {bad} must be integers below the talker vocab "
                              f"({vocab})")
        if predictor.num_code_groups != talker.num_code_groups:
            raise ConfigError(f"config.json: '{where}.code_predictor_config.num_code_groups' must equal "
                              f"{where}.num_code_groups")
        return talker

    def codec_ids(self) -> dict[str, Any]:
        """Every id the Talker feeds or samples by name (a subclass adds its speakers, languages...), each of which
        must index the codec table."""
        return {k: getattr(self, k) for k in self.CODEC_ID_KEYS}


class Qwen3TalkerModel(Qwen3Decoder):
    """The decoder stack with the code-0 table (`model.codec_embedding`)."""

    def __init__(self, cfg: Qwen3TalkerConfig):
        super().__init__(cfg.text)
        self.codec_embedding = nn.Embedding(cfg.text.vocab_size, cfg.text.hidden_size)


class Qwen3Talker(nn.Module):
    """`forward(None, positions, context, input_embeds=)` -> normed hidden `[T, H]`; `compute_logits` -> code 0 logits.

    A `kvcache` node module: the rows it reads (text or Thinker projections plus codec embeddings) are built
    outside. `projections` are the model's input projections, registered in order after `model` (their order
    is the checkpoint's and the seeded presets'); `predictor_width` is the width the code predictor's inputs come
    in, where the Talker is wider than the predictor (TTS 1.7B), else None.
    """

    def __init__(self, cfg: Qwen3TalkerConfig, model: Qwen3TalkerModel, projections: Mapping[str, nn.Module],
                 predictor_width: int | None = None):
        super().__init__()
        self.talker_config = cfg
        self.config = cfg.text
        self.model = model
        for name, module in projections.items():
            self.add_module(name, module)
        self.codec_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg.predictor, predictor_width)
        suppressed = torch.zeros(cfg.text.vocab_size, dtype=torch.bool, device="cpu")
        suppressed[cfg.suppress_from:] = True
        suppressed[cfg.codec_eos_token_id] = False
        self.suppressed = suppressed  # derived from the config, not a weight

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.codec_embedding(ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        context: AttentionContext,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embed(input_ids) if input_embeds is None else input_embeds
        hidden, _ = self.model.run(x, positions, context)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.codec_head(hidden)
        return logits.masked_fill(self.suppressed.to(logits.device), float("-inf"))
