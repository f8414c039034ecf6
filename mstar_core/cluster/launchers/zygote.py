"""A zygote for spawned workers: one process that has imported torch, the worker and the plugins, and forks workers.

A fresh `python -m mstar_core.cluster.worker` spends most of its start-up importing torch and the
plugins (seconds of CPU, before it can even join). The zygote pays that once per serving process:
each worker is then a fork of it that runs `worker.main` at once. The zygote stays single-threaded
and never runs a torch op, so a fork inherits no thread pool and no lock held by another thread
(torch's own `fork` handling then leaves each worker free to size its thread pool).

Protocol (JSON lines): the server writes `{"argv", "env", "cwd", "log"}` on the zygote's stdin; the zygote
answers `{"pid"}` (or `{"error"}`) on its stdout, and `{"exit": pid, "code": returncode}` when a
worker it forked ends. When the server goes (stdin closes) the zygote exits, and its workers, whose
parent it is, see their parent change and leave as they would have without it.
"""

from __future__ import annotations

import json
import os
import selectors
import sys
import traceback
from typing import NoReturn


def _run_worker(request: dict) -> NoReturn:
    """In the forked child: a session of its own, the log as stdout/stderr, the request's env; then the worker.

    It ends by raising SystemExit through the zygote's frames, so the interpreter exits as a plain
    worker's would (atexit handlers and finalizers run: shared memory segments are unlinked).
    """
    try:
        os.setsid()
        fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the zygote's pipes are not the worker's
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        from mstar_core.cluster.worker import main

        main(request["argv"])
    except SystemExit:
        raise
    except BaseException:  # never back into the zygote's loop
        traceback.print_exc()
        raise SystemExit(1) from None
    raise SystemExit(0)


def _reap(out) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        out.write(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")
        out.flush()


def serve() -> None:
    """The zygote's loop: import everything a worker needs, then fork one per request until stdin closes."""
    # CUDA initialised before a fork is unusable in the child: an import asking torch.cuda.is_available()
    # must not initialise it here (NVML answers instead; the workers get the server's environment back)
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    import torch

    import mstar_core.cluster.worker  # noqa: F401
    from mstar_core.plugins.manager import default_registry

    default_registry()  # plugin imports too (a worker's first call finds them loaded)
    if torch.cuda.is_initialized():  # an import used the GPU: forks could not; the server spawns plainly
        print("mstar worker zygote: CUDA was initialised while importing; not forking workers", file=sys.stderr)
        return
    out = sys.stdout
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    pending = b""  # raw reads, not sys.stdin: a buffered line would sit unseen by select
    while True:
        ready = selector.select(timeout=0.05)  # a short tick also reaps workers that ended
        _reap(out)
        if not ready:
            continue
        chunk = os.read(0, 65536)
        if not chunk:  # the serving process is gone
            return
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            _fork(json.loads(line), selector, out)


def _fork(request: dict, selector, out) -> None:
    try:
        pid = os.fork()
    except OSError as exc:  # answered, not fatal: the server falls back to a plain spawn
        out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return
    if pid == 0:
        selector.close()
        _run_worker(request)
    out.write(json.dumps({"pid": pid}) + "\n")
    out.flush()

if __name__ == "__main__":
    serve()
