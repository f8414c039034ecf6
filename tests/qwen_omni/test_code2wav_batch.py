"""Code2Wav windows of several requests decode as one batch per window shape, each as it would alone."""

import pytest
import torch
from mstar_qwen_omni.nodes import Code2WavWindow

from mstar_core.streaming import Chunk


def _window(g: torch.Generator, frames: int, context: int) -> Chunk:
    return Chunk(tuple(torch.randint(0, 16, (4,), generator=g) for _ in range(frames)), 0, context)


def test_batched_windows_equal_each_window_alone(omni):
    g = torch.Generator().manual_seed(0)
    node = Code2WavWindow(omni)
    calls = [{"codes": _window(g, 50, 25)}, {"codes": _window(g, 25, 0)}, {"codes": _window(g, 50, 25)},
             {"codes": _window(g, 30, 25)}, {"codes": _window(g, 50, 25)}]
    batched = node.forward_batch(calls)
    spf = omni.code2wav.samples_per_frame
    for call, out in zip(calls, batched, strict=True):
        chunk = call["codes"]
        frames = torch.stack(list(chunk.items), dim=1)[None]
        with torch.inference_mode():
            alone = omni.code2wav.decode_window(frames, chunk.num_context)[0, 0]
        assert out["audio"].shape == alone.shape and alone.numel() > (len(chunk.new_items) - 1) * spf
        # the batch's convolutions sum in another order: equal to the tolerance the transformers tests use
        assert (out["audio"] - alone).abs().max() < 1e-4
    # every request gets its own window back (distinct codes: a swapped row would differ by far more)
    assert (batched[0]["audio"] - batched[2]["audio"]).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_snake_beta_in_place_is_the_expression_bit_for_bit(dtype):
    from mstar_qwen_omni.code2wav import SnakeBeta

    act = SnakeBeta(16).to(dtype)
    with torch.no_grad():
        act.alpha.normal_()
        act.beta.normal_()
    x = (torch.randn(2, 16, 50) * 3).to(dtype)
    alpha, beta = act.alpha.exp()[None, :, None], act.beta.exp()[None, :, None]
    want = x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)
    with torch.no_grad():
        assert torch.equal(act(x), want)
    x.requires_grad_(True)  # (under autograd: the out-of-place ops, which backward needs)
    act(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
