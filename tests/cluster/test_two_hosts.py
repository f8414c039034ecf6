"""Two hosts (network namespaces joined by a veth pair): the server in one, `mstar worker --join` in the other.

Disaggregated tiny Orpheus across them gives the colocated audio; the control link is CURVE
encrypted (a capture of the veth shows no message names), a wrong key or none cannot join, and
killing the remote worker fails its request at once. Skipped, saying why, where namespaces cannot
be made (not root, no iproute2); the capture check is skipped without tcpdump.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.cluster.netns import two_hosts, unavailable

pytest.importorskip("mstar_orpheus")
pytestmark = pytest.mark.timeout(400)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SECRET = "two hosts share this secret"
PLAINTEXT_NAMES = (b"invoke_node", b"node_result", b"heartbeat", b"load_model", b"run_loop", b"orpheus")
PORT = 7100


async def colocated_audio():
    from mstar_core.cluster.strategy import placed_engine
    from mstar_core.config import load_placement
    from mstar_core.model import LoadOptions
    from mstar_core.plugins import discover
    from tests.cluster.two_host_server import REQUEST

    engine = placed_engine(discover())
    await engine.load_model("orpheus", LoadOptions(preset="tiny"),
                            placement=load_placement(ROOT / "examples" / "placement" / "orpheus-colocated.yaml"))
    try:
        return [torch.as_tensor(o.value).clone() async for o in engine.submit("orpheus", dict(REQUEST))
                if o.name == "audio"]
    finally:
        await engine.close()


def mstar_cmd() -> list[str]:
    script = Path(sys.executable).parent / "mstar"
    return [str(script)] if script.exists() else [sys.executable, "-m", "mstar_core.cli"]


async def test_orpheus_across_two_hosts_is_identical_encrypted_and_fails_cleanly(tmp_path):
    why = unavailable()
    if why:
        pytest.skip(f"two-host test needs network namespaces: {why}")
    reference = await colocated_audio()
    assert reference, "the tiny preset should produce audio"
    base_env = {k: v for k, v in os.environ.items() if k != "MSTAR_SECRET"}
    # this tree first, then what the caller had (a worktree puts its plugin packages there)
    base_env.update(HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    with two_hosts() as hosts:
        bind = f"tcp://{hosts.addr_a}:{PORT}"
        capture = None
        if shutil.which("tcpdump"):
            pcap = tmp_path / "veth.pcap"
            capture = hosts.popen(hosts.a, ["tcpdump", "-i", hosts.dev_a, "-U", "-s", "0", "-w", str(pcap), "tcp"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        server = hosts.popen(hosts.a, [sys.executable, str(HERE / "two_host_server.py"), str(tmp_path), bind,
                                       hosts.addr_b], env={**base_env, "MSTAR_SECRET": SECRET}, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def worker(secret, *extra, timeout="60"):
            env = {**base_env, "MSTAR_JOIN_TIMEOUT": timeout}
            if secret is not None:
                env["MSTAR_SECRET"] = secret
            return hosts.popen(hosts.b, [*mstar_cmd(), "worker", "--join", bind, "--name", "codec", *extra], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        intruders = [worker("a wrong secret of some length", timeout="8"), worker(None, timeout="8"),
                     worker(SECRET, "--encrypt", "off", timeout="8")]
        good = worker(SECRET)
        out, _ = server.communicate(timeout=300)
        assert server.returncode == 0, out
        result = json.loads((tmp_path / "result.json").read_text())
        for intruder in intruders:
            said, _ = intruder.communicate(timeout=60)
            assert intruder.returncode != 0, said
            assert "no answer" in said or "MSTAR_SECRET" in said, said
        good.wait(30)
        if capture is not None:
            capture.send_signal(signal.SIGINT)
            capture.wait(10)
    assert result["encrypted"] and result["joined_from"] and result["codec_pid"] == good.pid
    split = torch.load(tmp_path / "split.pt")
    assert len(split) == len(reference)
    for a, b in zip(reference, split, strict=True):
        assert torch.equal(a, b)
    kill = result["kill"]
    assert kill["failed"] and kill["type"] == "WorkerLost" and kill["status"] == 503, kill
    assert kill["seconds"] < 1.5, kill
    if capture is None:
        pytest.skip("tcpdump is not installed: the capture check did not run (apt-get install tcpdump)")
    data = pcap.read_bytes()
    assert len(data) > 50_000, "the capture saw no traffic on the link"
    assert not [name for name in PLAINTEXT_NAMES if name in data]
