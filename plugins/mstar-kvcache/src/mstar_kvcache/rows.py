"""Which hidden rows a call returns: every call of a per-token node, and a sampling call that asks for them."""

from __future__ import annotations

import torch

from mstar_kvcache.inputs import ParsedInvocation
from mstar_kvcache.sequence import Sequence


class CallRows:
    """Decides per call whether its rows are gathered (and from which token on), and narrows them once gathered.

    A node that samples returns its last row's outputs; its calls gather rows only when the node declares
    `compute_<name>` outputs and the call asks (option `output_rows` or input `output_index`).
    """

    def __init__(self, samples: bool, extra_outputs: list[str]):
        self.samples = samples
        self.extra_outputs = extra_outputs

    def wanted(self, call: ParsedInvocation) -> bool:
        """Whether the call's rows are gathered."""
        if not self.samples:
            return True
        return bool(self.extra_outputs) and (call.output_rows is not None or call.output_index is not None)

    def first(self, call: ParsedInvocation, start: int) -> int | None:
        """The first token (of the label) whose row the call returns; None when only its last row is needed."""
        if not self.wanted(call):
            return None
        if call.output_index is not None:
            n = len(call.ids)
            return start + min((int(i) % n for i in call.output_index), default=n - 1)
        # (a per-token node's "all" call still takes prefix hits and returns the rows after them, as before)
        return start if self.samples and call.output_rows == "all" else None

    @staticmethod
    def take(seq: Sequence) -> torch.Tensor:
        """The call's gathered hidden rows, narrowed to `output_index` or the last row when it asks (and let go)."""
        got = torch.cat(seq.collected) if len(seq.collected) > 1 else seq.collected[0]
        seq.collected = []
        call = seq.call
        if call.output_index is not None:
            n = len(call.ids)
            skipped = n - got.shape[0]  # leading rows a prefix hit reused (never one of those asked for)
            return got[(call.output_index % n - skipped).to(got.device)]
        return got[-1:] if call.output_rows == "last" else got
