"""Feed-forward blocks: gated SwiGLU (Llama/Qwen) and a plain two-layer GELU MLP (ViT/connector)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mstar_core.nn import cpu_elementwise
from mstar_core.nn.fused import fuse_on_load

_ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def activation(name: str):
    """Look up an activation by its HF `hidden_act` name."""
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; known: {sorted(_ACTIVATIONS)}") from None


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))`; with `act="silu"` this is SwiGLU.

    gate and up are one linear (`gate_up_proj`, gate rows first); `state_dict()` and
    `load_state_dict()` speak the HF names `gate_proj`, `up_proj`, `down_proj` (see `mstar_core.nn.fused`).
    """

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        fuse_on_load(self, "gate_up_proj", [("gate_proj", intermediate), ("up_proj", intermediate)])
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act is F.silu:  # one pass on CPU, the same roundings (None where it does not apply)
            fused = cpu_elementwise.silu_mul(gate_up, self.intermediate)
            if fused is not None:
                return self.down_proj(fused)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


SwiGLU = GatedMLP


class MLP(nn.Module):
    """`fc2(act(fc1(x)))`, GELU by default (ViT blocks, vision connectors)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "gelu", bias: bool = True, out: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate, bias=bias)
        self.fc2 = nn.Linear(intermediate, out or hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
