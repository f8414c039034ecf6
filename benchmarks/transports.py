"""Transport bandwidth: one tensor message from one process to another, against a plain memory copy.

For each transport (shm, zmq over IPC, zmq over loopback TCP, zmq over loopback TCP encrypted with
CURVE as the control link to another host is, torch.distributed gloo) and each size,
the parent sends an InvokeNode carrying one uint8 tensor to a real child process, which decodes it,
reads its first and last byte and answers with a tiny Release; bandwidth = size / median round trip.
The baseline is `dst.copy_(src)` of the same size (one thread, as the transports copy on one thread),
timed interleaved with the shm round trips so both see the same machine load. Final line: JSON with every figure, `shm_vs_memcpy_16mib` (target >= 0.5) and
`zmq_curve_vs_zmq_tcp_16mib` (what encryption costs at 16 MiB).

    python benchmarks/transports.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from mstar_core.wire import InvokeNode, Release
from mstar_core.wire.transport import free_tcp_port

KIB, MIB = 1 << 10, 1 << 20
#: The shared secret both ends of the CURVE run derive their keys from (a benchmark's, not a deployment's).
BENCH_SECRET = b"mstar-benchmark-secret"


def _make(kind: str):
    if kind == "shm":
        from mstar_transport_shm import ShmTransport

        return ShmTransport()
    if kind.startswith("zmq"):
        from mstar_transport_zmq import ZmqTransport

        return ZmqTransport(secret=BENCH_SECRET if kind == "zmq_curve" else None)
    from mstar_transport_nccl import NcclTransport

    return NcclTransport(backend="gloo", timeout_s=60)


def peer(kind: str, address: str) -> None:
    """Child: answer every tensor message with a Release, until a Release arrives."""
    torch.set_num_threads(1)
    t = _make(kind)
    t.connect(address)
    t.send_msg(Release(request_id="ready"))
    while True:
        m = t.recv_msg()
        if isinstance(m, Release):
            break
        x = m.inputs["x"]
        _ = int(x[0]) + int(x[-1])  # the data is there and readable
        del m, x
        t.send_msg(Release(request_id="ok"))
    t.close()


def _reps(size: int, quick: bool) -> int:
    budget = (64 if quick else 256) * MIB
    return max(10, min(30 if quick else 100, budget // size))


def bench_transport(kind: str, sizes: list[int], quick: bool) -> tuple[dict[int, float], dict[int, float]]:
    """(transport GB/s, interleaved memcpy GB/s) per size over `kind`, parent -> child."""
    t = _make(kind)
    if kind == "zmq_ipc":
        from mstar_transport_zmq.transport import ipc_address

        address = t.bind(ipc_address("mstar-bench"))
    elif kind == "shm":
        address = t.bind()
    elif kind in ("zmq_tcp", "zmq_curve"):
        address = t.bind("tcp://127.0.0.1:0")
    else:
        address = f"tcp://127.0.0.1:{free_tcp_port()}"
    child = subprocess.Popen([sys.executable, __file__, "--peer", kind, address])
    try:
        if kind == "gloo":
            t.bind(address)
        assert t.recv_msg() == Release(request_id="ready")
        out, copy = {}, {}
        for size in sizes:
            x = torch.randint(0, 255, (size,), dtype=torch.uint8)
            dst = torch.empty_like(x)
            msg = InvokeNode(request_id="r", node="bench", call_index=0, inputs={"x": x})
            times, ctimes = [], []
            for i in range(_reps(size, quick) + 1):
                t0 = time.perf_counter()
                dst.copy_(x)
                t1 = time.perf_counter()
                t.send_msg(msg)
                t.recv_msg()
                if i:  # the first round maps/creates buffers and faults pages in
                    ctimes.append(t1 - t0)
                    times.append(time.perf_counter() - t1)
            out[size] = size / statistics.median(times) / 1e9
            copy[size] = size / statistics.median(ctimes) / 1e9
        t.send_msg(Release(request_id="bye"))
        child.wait(60)
    finally:
        if child.poll() is None:
            child.kill()
        t.close()
    return out, copy


def _label(size: int) -> str:
    return f"{size // MIB}mib" if size >= MIB else f"{size // KIB}kib"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions (< 60 s)")
    ap.add_argument("--peer", nargs=2, metavar=("KIND", "ADDRESS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer:
        peer(*args.peer)
        return
    torch.set_num_threads(1)
    sizes = [KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB] if args.quick else [KIB << (2 * i) for i in range(9)]
    results = {}
    for kind in ["shm", "zmq_ipc", "zmq_tcp", "zmq_curve", "gloo"]:
        results[kind], copy = bench_transport(kind, sizes, args.quick)
        if kind == "shm":
            results["memcpy"] = copy
    results = {"memcpy": results.pop("memcpy"), **results}
    print(f"{'size':>8} " + " ".join(f"{k:>9}" for k in results) + "   (GB/s)")
    for s in sizes:
        print(f"{_label(s):>8} " + " ".join(f"{results[k][s]:9.2f}" for k in results))
    summary = {f"{k}_gbps_{_label(s)}": round(v[s], 3) for k, v in results.items() for s in sizes}
    summary["shm_vs_memcpy_16mib"] = round(results["shm"][16 * MIB] / results["memcpy"][16 * MIB], 3)
    summary["zmq_ipc_vs_memcpy_16mib"] = round(results["zmq_ipc"][16 * MIB] / results["memcpy"][16 * MIB], 3)
    summary["zmq_curve_vs_zmq_tcp_16mib"] = round(results["zmq_curve"][16 * MIB] / results["zmq_tcp"][16 * MIB], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
