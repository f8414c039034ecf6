"""Rank 0 of a split node tells the other ranks what to run: small typed messages over torch.distributed.

A message is a JSON header (plain values only) and named tensors. It travels as broadcasts from
rank 0: the header's length, the header's bytes, then one flat buffer per dtype holding that dtype's
tensors back to back. Nothing is pickled; the header says each tensor's name, dtype and shape.
Followers receive messages in the order rank 0 sent them, so the collectives a step's forward runs
after its message line up on every rank.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import torch
import torch.distributed as dist

#: the tensor dtypes a message may carry, by the name its header gives
DTYPES: dict[str, torch.dtype] = {
    "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool,
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class RankChannelError(RuntimeError):
    """A message that cannot travel (an unsupported dtype, a header that is not JSON) or did not arrive."""


def group_broken(exc: BaseException) -> bool:
    """Whether `exc` says the group itself failed (a rank's connection closed, a collective timed out).

    Then no later step can line up across the ranks: the rank should exit, so that the server replaces
    the whole group and fails its requests as lost, instead of answering them with the collective's error.
    """
    if isinstance(exc, RankChannelError) or isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return any(mark in text for mark in ("gloo/transport", "Connection closed by peer", "NCCL error",
                                         "Timed out waiting", "ProcessGroupNCCL", "ProcessGroupGloo"))


@attrs.frozen
class RankMessage:
    """One message: `header` (JSON-able plain values) and `tensors` by name."""

    header: dict[str, Any]
    tensors: dict[str, torch.Tensor] = attrs.field(factory=dict)


class RankChannel:
    """Broadcasts from rank 0 of `process_group` (None: the default group) to its other ranks.

    `device` is where the broadcast buffers live: the rank's CUDA device under NCCL, the CPU under gloo.
    """

    def __init__(self, rank: int, world_size: int, process_group: Any = None, device: torch.device | str = "cpu"):
        self.rank, self.world_size, self.process_group = rank, world_size, process_group
        self.device = torch.device(device)
        self.sent = 0  # messages, for stats and tests
        self.bytes_sent = 0

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=0, group=self.process_group)

    def send(self, header: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Rank 0: hand `header` and `tensors` to every other rank."""
        tensors = tensors or {}
        listed, by_dtype = [], {}
        for name, tensor in tensors.items():
            dtype = _NAMES.get(tensor.dtype)
            if dtype is None:
                raise RankChannelError(f"tensor '{name}' has dtype {tensor.dtype}, which rank messages do not carry")
            listed.append([name, dtype, list(tensor.shape)])
            by_dtype.setdefault(dtype, []).append(tensor.detach().reshape(-1))
        try:
            raw = json.dumps({"h": header, "t": listed}, separators=(",", ":")).encode()
        except (TypeError, ValueError) as exc:
            raise RankChannelError(f"a rank message header must be plain values: {exc}") from None
        self._broadcast(torch.tensor([len(raw)], dtype=torch.int64, device=self.device))
        self._broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device))
        for dtype in sorted(by_dtype):
            flat = torch.cat([t.to(self.device) for t in by_dtype[dtype]])
            self._broadcast(flat)
            self.bytes_sent += flat.numel() * flat.element_size()
        self.sent += 1
        self.bytes_sent += len(raw) + 8

    def receive(self) -> RankMessage:
        """A follower: the next message rank 0 sent (blocks until it comes)."""
        length = torch.empty(1, dtype=torch.int64, device=self.device)
        self._broadcast(length)
        raw = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(raw)
        try:
            body = json.loads(raw.cpu().numpy().tobytes())
            header, listed = body["h"], body["t"]
        except (ValueError, KeyError, TypeError) as exc:
            raise RankChannelError(f"rank 0 sent a header that is not a rank message: {exc}") from None
        tensors: dict[str, torch.Tensor] = {}
        sizes: dict[str, list[tuple[str, list[int]]]] = {}
        for name, dtype, shape in listed:
            if dtype not in DTYPES:
                raise RankChannelError(f"rank 0 sent tensor '{name}' of unknown dtype {dtype!r}")
            sizes.setdefault(dtype, []).append((name, shape))
        for dtype in sorted(sizes):
            counts = [int(torch.Size(shape).numel()) for _, shape in sizes[dtype]]
            flat = torch.empty(sum(counts), dtype=DTYPES[dtype], device=self.device)
            self._broadcast(flat)
            for (name, shape), part in zip(sizes[dtype], flat.split(counts), strict=True):
                tensors[name] = part.view(shape)
        return RankMessage(header, tensors)


@attrs.frozen(eq=False)
class RankGroup:
    """What an engine on a split node knows of its group: its module's collectives group and rank 0's channel.

    `split` is the `mstar_core.nn.parallel.TensorParallelGroup` the module's layers were split over;
    `channel` carries rank 0's step messages; `key` names the engine in them ('model/node').
    """

    split: Any
    channel: RankChannel
    key: str

    @property
    def rank(self) -> int:
        return self.channel.rank

    @property
    def world_size(self) -> int:
        return self.channel.world_size

    @property
    def leader(self) -> bool:
        return self.channel.rank == 0
