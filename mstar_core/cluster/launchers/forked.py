"""The serving process's side of the worker zygote (`zygote.py`): start it once, ask it for forks, track their exits.

A forked worker is the zygote's child, not ours, so its exit code comes over the zygote's pipe;
`ForkedProcess` turns that into the part of `subprocess.Popen` supervision uses. The zygote is
only used while this process's environment and working directory are those it started with (a
test that changes an environment variable gets a plain spawn, which reads the new value).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading

from mstar_core.wire.auth import SECRET_ENV

#: `MSTAR_WORKER_ZYGOTE=0` starts every worker as a fresh interpreter instead.
ZYGOTE_ENV = "MSTAR_WORKER_ZYGOTE"
#: How long a spawn waits for the zygote's imports before starting a fresh interpreter instead.
READY_TIMEOUT_S = 60.0


class ForkedProcess:
    """A worker the zygote forked: `pid`, `returncode`, `poll`, `wait`, `kill` as on `subprocess.Popen`."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Zygote:
    """One zygote process and the workers it forked for this process."""

    def __init__(self, key: tuple):
        self.key = key
        fd, self.log_path = tempfile.mkstemp(prefix="mstar-worker-zygote-", suffix=".log")
        try:
            # a session of its own like the workers: Ctrl-C reaches the server, whose exit closes the zygote's stdin
            self.process = subprocess.Popen([sys.executable, "-m", "mstar_core.cluster.launchers.zygote"],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fd,
                                            start_new_session=True)
        finally:
            os.close(fd)
        self.ready = threading.Event()
        self.gone = False
        self.worked = False  # it got ready once (one that never does is not started again: its imports fail)
        self._children: dict[int, ForkedProcess] = {}
        self._answers: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # one request at a time: answers come back in order
        threading.Thread(target=self._read, name="mstar-zygote-reader", daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            msg = json.loads(line)
            if "ready" in msg:
                self.worked = True
                self.ready.set()
            elif "exit" in msg:
                child = self._children.pop(msg["exit"], None)
                if child is not None:
                    child._exited(msg["code"])
            elif "pid" in msg:  # registered here, before any exit line about it can be read
                self._children[msg["pid"]] = child = ForkedProcess(msg["pid"])
                self._answers.put(child)
            else:
                self._answers.put(None)
        # the zygote is gone: its workers lost their parent and leave; make sure, and report them ended
        self.gone = True
        self.ready.set()
        self._answers.put(None)
        for child in list(self._children.values()):
            child.kill()
            child._exited(-signal.SIGKILL)
        self._children.clear()

    def fork(self, argv: list[str], env: dict[str, str], log_path: str) -> ForkedProcess | None:
        """A forked worker running `worker.main(argv + --parent-pid)`, or None if the zygote cannot (spawn it plainly)."""
        with self._lock:
            if not self.ready.wait(READY_TIMEOUT_S) or self.gone:
                return None
            # the worker's parent is the zygote: it leaves when that goes (which goes with this process)
            argv = [*argv, "--parent-pid", str(self.process.pid)]
            request = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": log_path}
            try:
                self.process.stdin.write((json.dumps(request) + "\n").encode())
                self.process.stdin.flush()
            except OSError:
                return None
            try:
                return self._answers.get(timeout=READY_TIMEOUT_S)
            except queue.Empty:  # a late answer would be read as the next request's: use this zygote no more
                self.gone = True
                return None


_zygote: Zygote | None = None
_zygote_lock = threading.Lock()


#: Variables not part of the zygote's key: each worker's own (the secret, its thread count), and those that change
#: while a process runs and nothing reads at import (pytest rewrites PYTEST_CURRENT_TEST every test phase).
#: The worker still gets their current values.
_VOLATILE = frozenset({SECRET_ENV, "MSTAR_WORKER_THREADS", "PYTEST_CURRENT_TEST"})


def _key(env: dict[str, str]) -> tuple:
    """What a zygote's imports may depend on: anything else differing means it would not be a plain spawn's twin.

    (And this process: a fork of the serving process does not share its zygote's pipe.)
    """
    return os.getpid(), os.getcwd(), sys.executable, tuple(sorted((k, v) for k, v in env.items() if k not in _VOLATILE))


def fork_worker(argv: list[str], env: dict[str, str], per_worker: dict[str, str], log_path: str) -> ForkedProcess | None:
    """Fork a worker from this process's zygote (started on first use); None when it is off or cannot.

    `env` is what a plain spawn would pass minus `per_worker` (the secret, the thread count), which
    only this worker gets; a different `env` than the zygote started with means no zygote.
    """
    global _zygote
    if os.environ.get(ZYGOTE_ENV, "1") == "0" or not hasattr(os, "fork"):
        return None
    with _zygote_lock:
        if _zygote is None or (_zygote.gone and _zygote.worked and _zygote.key == _key(env)):
            _zygote = Zygote(_key(env))
        zygote = _zygote
    if zygote.key != _key(env):
        return None
    return zygote.fork(argv, {**env, **per_worker}, log_path)
