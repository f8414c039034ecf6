"""The AC predictor matches an independent transcription of upstream's forward (HF's RoPE helper, full mask)."""

import pytest
import torch
import torch.nn.functional as F

hf_vjepa = pytest.importorskip("transformers.models.vjepa2.modeling_vjepa2")
rot = hf_vjepa.rotate_queries_or_keys


def upstream_forward(m, x, actions, states):
    """Upstream VisionTransformerPredictorAC.forward as documented: tokens [a, s, patches] per step."""
    cfg = m.cfg
    x = m.predictor_embed(x)
    b, t, p, d = x.shape
    x = torch.cat([m.action_encoder(actions)[:, :, None], m.state_encoder(states)[:, :, None], x], 2).flatten(1, 2)
    n_t = p + 2
    frame = torch.arange(t).repeat_interleave(n_t)
    mask = frame[None, :] <= frame[:, None]
    g = cfg.grid_size
    heads, hd = cfg.num_heads, d // cfg.num_heads
    dd = 2 * ((hd // 3) // 2)
    ids = torch.arange(t * p)
    fpos, hpos, wpos = (ids // p).float(), ((ids % p) // g).float(), (ids % g).float()
    for blk in m.predictor_blocks:
        y = blk.norm1(x)
        qkv = blk.attn.qkv(y).unflatten(-1, (3, heads, hd)).permute(2, 0, 3, 1, 4)  # [3, B, H, N, hd]
        q, k, v = (z.view(b, heads, t, n_t, hd) for z in qkv)

        def rope(z):
            cond = z[:, :, :, :2]
            cond = torch.cat([rot(cond[..., :dd].transpose(2, 3).reshape(b, heads * 2, t, dd), torch.arange(t).float())
                              .view(b, heads, 2, t, dd).transpose(2, 3), cond[..., dd:]], -1)
            pat = z[:, :, :, 2:].reshape(b, heads, t * p, hd)
            pat = torch.cat([rot(pat[..., :dd], fpos), rot(pat[..., dd:2 * dd], hpos), rot(pat[..., 2 * dd:3 * dd], wpos),
                             pat[..., 3 * dd:]], -1).view(b, heads, t, p, hd)
            return torch.cat([cond, pat], 3).flatten(2, 3)

        out = F.scaled_dot_product_attention(rope(q), rope(k), v.flatten(2, 3), attn_mask=mask)
        x = x + blk.attn.proj(out.transpose(1, 2).reshape(b, t * n_t, d))
        x = x + blk.mlp(blk.norm2(x))
    x = x.view(b, t, n_t, d)[:, :, 2:]
    return m.predictor_proj(m.predictor_norm(x))


def test_matches_upstream_transcription(ac_predictor):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 4, 32, generator=g)
    a, s = torch.randn(2, 5, 7, generator=g), torch.randn(2, 5, 7, generator=g)
    with torch.no_grad():
        ref = upstream_forward(ac_predictor, x, a, s)
        got = ac_predictor(x, a, s)
    assert (got - ref).abs().max().item() <= 1e-5
