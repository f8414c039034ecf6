"""Seeded random inputs for the AC world-model tests."""

import torch


def random_states(n: int, seed: int = 1) -> torch.Tensor:
    """`n` 7-D robot states (end-effector pose and gripper), seeded."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, 7, generator=g) * 0.3
    s[:, 6] = torch.rand(n, generator=g)
    return s
