"""`on_meta()`: the same parameters as a plain meta build, without running initialisers on meta tensors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm
from torch.overrides import TorchFunctionMode

from mstar_core.checkpoint.meta import _INIT_FUNCTIONS, _TENSOR_FILLS, on_meta
from mstar_core.nn import LlamaForCausalLM

LLAMA = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}


def _folded_convs() -> nn.Module:
    """Weight-normalised convs (dims 0 and 1), folded as SNAC does after building."""
    m = nn.Sequential(weight_norm(nn.Conv1d(6, 4, 3)), weight_norm(nn.ConvTranspose1d(4, 6, 4, stride=2)),
                      weight_norm(nn.Linear(5, 3), dim=None))
    for layer in m:
        parametrize.remove_parametrizations(layer, "weight", leave_parametrized=True)
    return m


def _snac() -> nn.Module:
    """Orpheus' SNAC decoder (weight-normalised convs, noise, Snake), folded as the model builds it."""
    snac = pytest.importorskip("mstar_orpheus.snac.model")
    from mstar_orpheus.preset import TINY_SNAC

    return snac.SNACDecoder(TINY_SNAC).fold_weight_norm()


FACTORIES = {
    "snac": _snac,
    "llama": lambda: LlamaForCausalLM(LLAMA),
    "qwen3-tied": lambda: LlamaForCausalLM({**LLAMA, "model_type": "qwen3", "tie_word_embeddings": True}),
    "weight-norm": _folded_convs,
    "layers": lambda: nn.Sequential(nn.Embedding(10, 4, padding_idx=0), nn.LayerNorm(4), nn.Conv2d(4, 8, 3),
                                    nn.MultiheadAttention(8, 2), nn.GRU(8, 8)),
}


def _layout(module: nn.Module) -> list[tuple]:
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return [(name, tuple(t.shape), t.dtype, t.requires_grad, t.device.type) for name, t in tensors]


class _Seen(TorchFunctionMode):
    """Records which torch functions reach it (it sits below `on_meta`)."""

    def __init__(self):
        super().__init__()
        self.funcs = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.funcs.add(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_same_parameters_as_a_plain_meta_build(name):
    with torch.device("meta"):
        plain = FACTORIES[name]()
    with on_meta():
        fast = FACTORIES[name]()
    assert _layout(fast) == _layout(plain)
    assert all(t.is_meta for t in fast.parameters())
    built = FACTORIES[name]()  # and the real build, apart from the device
    assert [row[:4] for row in _layout(fast)] == [row[:4] for row in _layout(built)]


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_no_initialiser_runs_on_meta(name):
    with torch.device("meta"), _Seen() as plain:
        FACTORIES[name]()
    with _Seen() as seen, on_meta():
        FACTORIES[name]()
    assert plain.funcs & (_INIT_FUNCTIONS | _TENSOR_FILLS)  # the plain build runs them (so the check can fail)
    assert not seen.funcs & (_INIT_FUNCTIONS | _TENSOR_FILLS | {torch.norm_except_dim, torch._weight_norm})


def test_tensors_off_meta_are_initialised_as_usual():
    torch.manual_seed(3)
    want = nn.init.normal_(torch.empty(6), 0.0, 2.0), nn.init.kaiming_uniform_(torch.empty(3, 4)), torch.randn(2)
    torch.manual_seed(3)
    with on_meta():
        got = (nn.init.normal_(torch.empty(6, device="cpu"), 0.0, 2.0),
               nn.init.kaiming_uniform_(torch.empty(3, 4, device="cpu")), torch.randn(2, device="cpu"))
        assert torch.empty(1).is_meta  # the default device is still meta
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape, dim", [(shape, dim) for shape in [(4, 6, 3), (5, 7), (3,)]
                                         for dim in [0, 1, -1, None] if dim != 1 or len(shape) > 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [True, False])
def test_weight_norm_on_meta_has_the_real_result_shape(shape, dim, dtype, grad):
    dim = -1 if dim is None else dim
    v = torch.randn(shape, dtype=dtype, requires_grad=grad)
    g = torch.norm_except_dim(v, 2, dim)
    w = torch._weight_norm(v, g, dim)
    v_meta = v.detach().to("meta").requires_grad_(grad)
    with on_meta():
        g_meta = torch.norm_except_dim(v_meta, 2, dim)
        w_meta = torch._weight_norm(v_meta, g_meta, dim)
        with torch.no_grad():
            assert not torch._weight_norm(v_meta, g_meta, dim).requires_grad
    for real, meta in ((g, g_meta), (w, w_meta)):
        assert (meta.shape, meta.dtype, meta.requires_grad, meta.is_meta) == (real.shape, real.dtype, grad, True)


def test_a_sincos_table_built_on_meta_is_left_to_the_checkpoint():
    from mstar_core.nn.sincos import PositionTable

    with on_meta():
        table = PositionTable(4, 8)
        with pytest.raises(ValueError, match="divisible by 4"):
            PositionTable(4, 6)
    assert _layout(table) == [("pos_embed", (16, 8), torch.float32, False, "meta")]
    assert [row[:4] for row in _layout(PositionTable(4, 8))] == [row[:4] for row in _layout(table)]
