"""The one error a checkpoint load raises, listing every problem by weight name."""

from __future__ import annotations

from collections.abc import Sequence

from mstar_core.errors import MStarError


class CheckpointError(MStarError):
    """A checkpoint does not match the model: missing, unexpected or mis-shaped weights, or a bad file."""


class WeightMismatchError(CheckpointError):
    """Lists missing, unexpected and mis-shaped weights together so one load shows every problem."""

    def __init__(
        self,
        where: str,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mis_shaped: Sequence[tuple[str, tuple[int, ...], tuple[int, ...]]] = (),
    ):
        self.missing, self.unexpected, self.mis_shaped = list(missing), list(unexpected), list(mis_shaped)
        lines = [f"checkpoint {where} does not match the model:"]
        if self.missing:
            lines.append(f"  missing ({len(self.missing)}): " + ", ".join(self.missing))
        if self.unexpected:
            lines.append(f"  unexpected ({len(self.unexpected)}): " + ", ".join(self.unexpected))
        for name, got, want in self.mis_shaped:
            lines.append(f"  mis-shaped: {name}: checkpoint {list(got)}, model expects {list(want)}")
        lines.append("  check that config.json belongs to these weights, or fix the model's weight-name mapping.")
        super().__init__("\n".join(lines))
