"""torch.distributed transport for M*: NCCL send/recv of device tensors, gloo on CPU (testable anywhere)."""

from mstar_transport_nccl.transport import NcclTransport

__all__ = ["NcclTransport"]
