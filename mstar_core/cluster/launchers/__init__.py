"""How the server starts worker processes: `spawn` (a subprocess here) or `ray` (an actor on a Ray cluster).

A launcher returns a process handle with the part of `subprocess.Popen`'s interface supervision
uses (`poll`, `returncode`, `kill`, `wait`, `pid`), so detection and restart do not care which one
started the worker.
"""

from mstar_core.cluster.launchers.spawn import spawn_worker

__all__ = ["spawn_worker"]
