"""`mstar serve orpheus --config <placement>`: the disaggregated model (shm workers) behind the real HTTP server."""

import io
import os
import signal
import wave
from pathlib import Path

import httpx
import pytest

from tests.server.helpers import Server

pytest.importorskip("mstar_orpheus")
pytestmark = pytest.mark.timeout(180)

PLACEMENT = Path(__file__).resolve().parents[2] / "examples" / "placement" / "orpheus-disaggregated-shm.yaml"


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
        except OSError:
            pass
    return kids


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def worker_pids(server_pid: int) -> list[int]:
    """The server's workers: its worker subprocesses, or the forks of its worker zygote."""
    pids = []
    for pid in _children(server_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_text()
        except OSError:
            continue
        if "mstar_core.cluster.worker" in cmdline:
            pids.append(pid)
        elif "mstar_core.cluster.launchers.zygote" in cmdline:
            pids += _children(pid)
    return pids


def test_serve_with_a_placement_file_and_stop_cleanly():
    srv = Server(["orpheus"], "--config", str(PLACEMENT), api_key=None)
    pids = [srv.proc.pid]
    try:
        pids += worker_pids(srv.proc.pid)
        assert len(pids) == 3
        body = {"model": "orpheus", "input": "Hello there", "voice": "tara", "response_format": "wav", "seed": 3}
        r = httpx.post(f"{srv.url}/v1/audio/speech", json=body, timeout=120)
        assert r.status_code == 200, r.text
        with wave.open(io.BytesIO(r.content)) as w:
            assert w.getframerate() == 24000 and w.getnframes() > 0
    finally:
        srv.proc.send_signal(signal.SIGINT)
        code = srv.proc.wait(timeout=60)
    assert code == 0, srv.output()[-3000:]
    assert "Traceback" not in srv.output(), srv.output()[-3000:]
    assert [p for p in pids[1:] if _running(p)] == []  # the workers left with the server
    left = [n for n in os.listdir("/dev/shm") for p in pids if n.startswith(f"mstar-shm-{p}-")]
    assert left == [], left
