"""The `spawn` launcher: the worker is `python -m mstar_core.cluster.worker` in a subprocess on this host.

By default the subprocess is a fork of this process's worker zygote (`zygote.py`: torch and the
plugins imported once), else a fresh interpreter. It blocks while the zygote starts: call it off the event loop.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from mstar_core.cluster.launchers.forked import ForkedProcess, fork_worker
from mstar_core.wire.auth import SECRET_ENV


def spawn_worker(name: str, join: str, secret: bytes, threads: int | None = None,
                 encrypt: bool = False) -> tuple[subprocess.Popen | ForkedProcess, str]:
    """Start one worker subprocess; returns (process, path of its log file)."""
    fd, log_path = tempfile.mkstemp(prefix=f"mstar-worker-{name}-", suffix=".log")
    per_worker = {SECRET_ENV: secret.decode()}
    if threads is not None:
        per_worker["MSTAR_WORKER_THREADS"] = str(threads)
    env = {k: v for k, v in os.environ.items() if k not in per_worker}
    args = ["--join", join, "--name", name, "--encrypt", "on" if encrypt else "off"]
    try:
        forked = fork_worker(args, env, per_worker, log_path)
        if forked is not None:
            return forked, log_path
        cmd = [sys.executable, "-m", "mstar_core.cluster.worker", *args, "--parent-pid", str(os.getpid())]
        # a session of its own: Ctrl-C in a terminal reaches the server, which then shuts the workers down
        process = subprocess.Popen(cmd, env={**env, **per_worker}, stdout=fd, stderr=fd, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    finally:
        os.close(fd)
    return process, log_path
