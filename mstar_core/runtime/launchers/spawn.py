"""The `spawn` launcher: the worker is `python -m mstar_core.runtime.worker` in a subprocess on this host."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from mstar_core.wire.auth import SECRET_ENV


def spawn_worker(name: str, join: str, secret: bytes, threads: int | None = None,
                 encrypt: bool = False) -> tuple[subprocess.Popen, str]:
    """Start one worker subprocess; returns (process, path of its log file)."""
    fd, log_path = tempfile.mkstemp(prefix=f"mstar-worker-{name}-", suffix=".log")
    env = {**os.environ, SECRET_ENV: secret.decode()}
    if threads is not None:
        env["MSTAR_WORKER_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "mstar_core.runtime.worker", "--join", join, "--name", name,
           "--parent-pid", str(os.getpid()), "--encrypt", "on" if encrypt else "off"]
    try:
        # a session of its own: Ctrl-C in a terminal reaches the server, which then shuts the workers down
        process = subprocess.Popen(cmd, env=env, stdout=fd, stderr=fd, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    finally:
        os.close(fd)
    return process, log_path
