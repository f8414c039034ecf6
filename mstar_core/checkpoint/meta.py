"""Build modules on the meta device without running their random initialisers.

A module built under `torch.device("meta")` still runs its `reset_parameters`. On meta tensors
those fills change nothing (a meta tensor has no data), yet `normal_` there runs torch's Python
reference decomposition: its first call imports `torch._refs` (seconds of a worker's start-up) and
each later one costs about a millisecond. `on_meta()` skips exactly these calls when their target
is a meta tensor; shapes, dtypes, parameter names and everything off the meta device stay as they are.
Weight normalisation's two ops (registering it computes a norm, folding it the weight) hit the same
decompositions on meta, so there they give an empty meta tensor of the shape the op would return.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

#: `torch.nn.init`'s in-place initialisers: they reach a torch-function mode as themselves (the
#: tensor methods they call inside then run with the mode off), so they are skipped by name.
_INIT_FUNCTIONS = frozenset(
    getattr(nn.init, name) for name in (
        "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
        "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_",
    )
)
#: In-place fills a module may call on its own tensors: random draws whose only effect is on the data.
_TENSOR_FILLS = frozenset(
    getattr(torch.Tensor, name) for name in (
        "normal_", "uniform_", "random_", "exponential_", "cauchy_", "log_normal_", "geometric_", "bernoulli_",
    )
)
_SKIPPED = _INIT_FUNCTIONS | _TENSOR_FILLS


def _norm_except_dim(v: torch.Tensor, pow: float = 2, dim: int = 0) -> torch.Tensor:
    """The p-norm over every dim but `dim` (kept, the others size 1); a scalar when `dim` is -1."""
    shape = [] if dim == -1 else [v.shape[i] if i == dim % v.dim() else 1 for i in range(v.dim())]
    return _result(shape, v.dtype, v)


def _weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """g * v / ||v||: the shape of `v`."""
    return _result(v.shape, v.dtype, v, g)


def _result(shape, dtype: torch.dtype, *inputs: torch.Tensor) -> torch.Tensor:
    # requires_grad as autograd would set it: folding weight norm keeps a weight that requires grad as a Parameter
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


#: ops whose result on meta is computed from the shapes alone instead of torch's decomposition
_SHAPE_ONLY = {torch.norm_except_dim: _norm_except_dim, torch._weight_norm: _weight_norm}


class _SkipMetaInit(TorchFunctionMode):
    """Skips initialisers of meta tensors and gives weight norm's results on meta by shape; runs everything else."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SKIPPED:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        elif func in _SHAPE_ONLY and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return _SHAPE_ONLY[func](*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """`torch.device("meta")` with random initialisers of meta tensors skipped (nothing to fill there)."""
    with torch.device("meta"), _SkipMetaInit():
        yield
