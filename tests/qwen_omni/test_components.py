"""Fidelity of every component against transformers' Qwen3OmniMoe built from the same tiny checkpoint files."""

import json

import pytest
import torch
from mstar_qwen_omni.audio_encoder import audio_token_count
from mstar_qwen_omni.config import OmniConfig
from mstar_qwen_omni.positions import prompt_positions

from mstar_core.nn import DenseAttention

TOL = 1e-4


def _close(a, b):
    return (a - b).abs().max().item()


def test_checkpoint_is_in_the_published_layout(tiny_dir):
    index = json.loads((tiny_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model-{i:05d}-of-00015.safetensors" for i in range(1, 16)]
    names = set(index["weight_map"])
    assert "thinker.model.layers.0.mlp.experts.7.down_proj.weight" in names
    assert "talker.model.layers.1.mlp.experts.0.gate_proj.weight" in names
    assert "talker.model.layers.1.mlp.shared_expert_gate.weight" in names
    assert {"thinker.lm_head.weight", "talker.codec_head.weight", "code2wav.code_embedding.weight"} <= names
    assert {n.split(".")[0] for n in names} == {"thinker", "talker", "code2wav"}
    assert not any(n.endswith("gate_up_proj") for n in names)


def test_config_reads_both_rope_layouts(tiny_dir):
    raw = json.loads((tiny_dir / "config.json").read_text())
    old = OmniConfig.from_hf(raw)
    text = raw["thinker_config"]["text_config"]
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": text.pop("rope_theta"),
                               **text.pop("rope_scaling")}
    new = OmniConfig.from_hf(raw)
    assert new.thinker.text == old.thinker.text
    assert old.thinker.text.mrope_section == (1, 1, 2) and old.thinker.text.rope_theta == 1e6


def test_thinker_text_logits(omni, hf):
    ids = torch.randint(0, 300, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf.thinker(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
        out = omni.thinker.compute_logits(omni.thinker(ids[0], torch.arange(17), DenseAttention()))
    assert _close(out, ref) < TOL


def _splice(thinker, ids, rows, token_id):
    embeds = thinker.embed(ids)
    embeds[ids == token_id] = rows
    return embeds


def test_thinker_audio_logits(omni, hf):
    cfg = omni.config
    frames = 230  # two full 100-frame chunks and a tail: windowed attention and per-chunk positions both matter
    feats = torch.randn(1, cfg.thinker.audio.num_mel_bins, frames, generator=torch.Generator().manual_seed(1))
    n = audio_token_count(frames)
    t = cfg.thinker
    ids = torch.tensor([[5, 9, t.audio_start_token_id, *[t.audio_token_id] * n, t.audio_end_token_id, 7, 11]])
    with torch.no_grad():
        ref = hf.thinker(input_ids=ids, attention_mask=torch.ones_like(ids), input_features=feats,
                         feature_attention_mask=torch.ones(1, frames, dtype=torch.long)).logits[0]
        audio = omni.thinker.audio_tower(feats[0])
        assert audio.shape == (n, t.text.hidden_size)
        embeds = _splice(omni.thinker, ids[0], audio, t.audio_token_id)
        pos = prompt_positions(ids[0].tolist(), t.image_token_id)
        out = omni.thinker.compute_logits(omni.thinker(None, pos, DenseAttention(), input_embeds=embeds))
    assert _close(out, ref) < TOL


def test_thinker_image_logits_with_deepstack(omni, hf):
    t = omni.config.thinker
    grid = torch.tensor([[1, 4, 6]])
    v = t.vision
    patches = torch.randn(24, v.in_channels * v.temporal_patch_size * v.patch_size**2,
                          generator=torch.Generator().manual_seed(2))
    n = 24 // v.spatial_merge_size**2
    ids = torch.tensor([[5, t.vision_start_token_id, *[t.image_token_id] * n, t.vision_end_token_id, 7, 11, 13]])
    with torch.no_grad():
        ref = hf.thinker(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=patches,
                         image_grid_thw=grid).logits[0]
        merged, deep = omni.thinker.visual(patches, grid)
        embeds = _splice(omni.thinker, ids[0], merged, t.image_token_id)
        deepstack = torch.zeros(ids.shape[1], deep.shape[1], deep.shape[2])
        deepstack[ids[0] == t.image_token_id] = deep
        pos = prompt_positions(ids[0].tolist(), t.image_token_id, grid.tolist(), v.spatial_merge_size,
                               t.position_id_per_seconds)
        assert pos[1:, 2 : 2 + n].max() > pos[0, 2]  # the image really spreads over (h, w)
        out = omni.thinker.compute_logits(omni.thinker(None, pos, DenseAttention(), input_embeds=embeds,
                                                       deepstack=deepstack))
    assert _close(out, ref) < TOL


def test_talker_forward_and_codec_head(omni, hf):
    h = omni.config.talker.text.hidden_size
    x = torch.randn(1, 9, h, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(9).view(1, 1, -1).expand(3, 1, -1)
    with torch.no_grad():
        ref = hf.talker.model(inputs_embeds=x, position_ids=pos).last_hidden_state[0]
        out = omni.talker(None, pos[:, 0], DenseAttention(), input_embeds=x[0])
        assert _close(out, ref) < TOL
        assert _close(omni.talker.codec_head(out), hf.talker.codec_head(ref)) < TOL
        proj = torch.randn(4, omni.config.thinker.text.hidden_size)
        assert _close(omni.talker.text_projection(proj), hf.talker.text_projection(proj)) < TOL
        assert _close(omni.talker.hidden_projection(proj), hf.talker.hidden_projection(proj)) < TOL


def test_code_predictor_heads(omni, hf):
    cp = omni.talker.code_predictor
    v, heads = cp.codebook, cp.heads
    seed = torch.randn(1, 2, cp.predictor_config.hidden_size, generator=torch.Generator().manual_seed(4))
    codes = torch.randint(0, v, (heads - 1,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        # reference: the whole frame at once, head g on position g + 1
        steps = [hf.talker.code_predictor.model.codec_embedding[g](codes[g : g + 1]) for g in range(heads - 1)]
        x = torch.cat([seed[0], *steps])[None]
        hidden = hf.talker.code_predictor.model(inputs_embeds=x).last_hidden_state[0]
        ref = torch.stack([hf.talker.code_predictor.lm_head[g](hidden[g + 1]) for g in range(heads)])
        joined = torch.tensor([g * v + c for g, c in enumerate(codes.tolist())])
        embeds = torch.cat([seed[0], cp.embed(joined)])
        rows = cp(None, torch.arange(heads + 1), DenseAttention(), input_embeds=embeds)
        logits = cp.compute_logits(rows[1:]).view(heads, heads, v)
    for g in range(heads):
        assert _close(logits[g, g], ref[g]) < TOL
        assert torch.isinf(logits[g]).sum() == (heads - 1) * v  # only its own head's ids may be sampled
    # a batch mixing heads in any order (repeats included) gives each row its own head's logits
    order = torch.tensor([2, 0, 2, 1, 0][: 2 * heads])
    with torch.no_grad():
        mixed = cp.compute_logits(rows[1:][order]).view(-1, heads, v)
    for i, g in enumerate(order.tolist()):
        assert _close(mixed[i, g], logits[g, g]) < 1e-6
        assert torch.isinf(mixed[i]).sum() == (heads - 1) * v


def test_code2wav_and_its_chunked_decode(omni, hf):
    cfg = omni.config.code2wav
    codes = torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers, 60), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = hf.code2wav(codes)
        out = omni.code2wav(codes)
        # each transposed-conv stage trims kernel - stride samples per side: a window yields a few samples
        # less than frames * samples_per_frame, as in the reference
        assert out.shape == ref.shape and out.shape[-1] <= 60 * cfg.samples_per_frame
        assert _close(out, ref) < TOL
        chunked = omni.code2wav.chunked_decode(codes, 25, 25)
        ref_chunked = hf.code2wav.chunked_decode(codes, chunk_size=25, left_context_size=25)
    assert chunked.shape == ref_chunked.shape
    assert _close(chunked, ref_chunked) < TOL
    n = min(chunked.shape[-1], ref.shape[-1])
    assert _close(chunked[..., :n], ref[..., :n]) > TOL  # the windows really cut the context


@pytest.mark.parametrize("frames", [1, 99, 100, 101, 230, 800])
def test_audio_token_count_matches_reference(frames):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    assert audio_token_count(frames) == int(_get_feat_extract_output_lengths(torch.tensor(frames)))
