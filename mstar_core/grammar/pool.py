"""`CompilePool`: grammar compiles in a few killable processes, behind a bounded queue, each under a time budget.

Compiles run in worker processes (`worker.py`), one compile each at a time, `limits.compile_workers()` of them; a
daemon thread per process hands it jobs and waits for its answer. At most `limits.compile_queue()` jobs wait for a
process: one more is refused at once (`CompileQueueFull`, a 503 with Retry-After), never queued behind the others.
A job's compile that runs past its budget, or whose every waiter went away (its request was refused, timed out or
disconnected), has its process killed; the next job gets a fresh one, forked in tens of milliseconds.

Threads are daemons and processes are killed with the server (and with the fork server), so nothing here keeps
a stopping server waiting on a compile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import attrs

from mstar_core.errors import RequestError
from mstar_core.grammar import limits, protocol, zygote
from mstar_core.grammar.spec import GrammarSpec
from mstar_core.grammar.vocab import GrammarVocab

log = logging.getLogger("mstar.grammar")

#: Seconds the zygote may take to start (importing xgrammar and torch: seconds on a loaded machine).
ZYGOTE_START_S = 120.0
#: Seconds a fresh process may take to load a vocabulary (trusted data from the model, not the request).
VOCAB_LOAD_S = 120.0
_PAGE = os.sysconf("SC_PAGE_SIZE")
#: How often a waiting thread looks for a cancelled job (and so how soon a cancelled compile is killed).
POLL_S = 0.05


class CompileQueueFull(RequestError):
    """Every compile process is busy and the queue is full: retry shortly (a 503 with Retry-After)."""

    status = 503
    error_type = "server_overloaded"

    def __init__(self, message: str, *, retry_after_s: float, param: str | None = None):
        super().__init__(message, param=param)
        self.retry_after_s = retry_after_s


class CompileFailed(RequestError):
    """The grammar did not compile: refused by the library, past its budget, or its process died (a 400)."""


class CompileCancelled(RequestError):
    """Every request waiting for this compile went away; its process was killed."""

    status = 499


@attrs.define(eq=False)
class CompileJob:
    """One grammar to compile for one vocabulary, shared by every request waiting for it."""

    key: tuple[str, str]
    vocab: GrammarVocab
    spec: GrammarSpec
    budget_s: float
    #: The serialised `CompiledGrammar` (JSON text) and the compile's milliseconds, or a `RequestError`.
    future: Future = attrs.field(factory=Future)
    waiters: int = 1
    cancelled: bool = False


class _Zygote:
    """The process compile processes are forked from (`zygote.py`), started on first use and again if it died."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._ctrl: socket.socket | None = None

    def ensure(self) -> None:
        """Started (again, if it died)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()

    def fork(self) -> tuple[int, Connection]:
        """A fresh compile process: its pid and the connection to it."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            here, there = socket.socketpair()
            try:
                socket.send_fds(self._ctrl, [b"F"], [there.fileno()])
                pid = zygote.PID.unpack(_read_exactly(self._ctrl, zygote.PID.size))[0]
            except OSError:
                here.close()
                self.stop()
                raise
            finally:
                there.close()
            return pid, Connection(here.detach())

    def _start(self) -> None:
        self.stop()
        here, there = socket.socketpair()
        self._proc = subprocess.Popen([sys.executable, "-m", "mstar_core.grammar.zygote", str(there.fileno())],
                                      pass_fds=[there.fileno()], stdin=subprocess.DEVNULL)
        there.close()
        here.settimeout(ZYGOTE_START_S)
        try:
            if _read_exactly(here, 1) != b"R":
                raise OSError("the grammar zygote did not start")
        except (OSError, TimeoutError):
            here.close()
            self._proc.kill()
            raise
        here.settimeout(None)
        self._ctrl = here

    def stop(self) -> None:
        if self._ctrl is not None:
            self._ctrl.close()
            self._ctrl = None
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise OSError("the grammar zygote closed its socket")
        data += chunk
    return data


#: One zygote per server process, whichever pools fork from it.
_ZYGOTE = _Zygote()


class _Worker:
    """One compile process (forked by the zygote) and the vocabularies it has been sent."""

    def __init__(self, parent: _Zygote):
        self.pid, self.conn = parent.fork()
        self.vocabs: set[str] = set()
        self.dead = False

    @property
    def alive(self) -> bool:
        return not self.dead

    def compile(self, vocab_key: str, job: CompileJob) -> tuple[str, float]:
        """The job compiled here: (serialised grammar, milliseconds); raises `CompileFailed` / `CompileCancelled`
        (the caller kills this process after either, except a refusal by the library)."""
        if self.dead:
            raise CompileFailed("the grammar compiler stopped")
        if vocab_key not in self.vocabs:  # the model's cost, not the request's: it has its own allowance
            vocab = job.vocab
            self._send(protocol.frame(
                {"op": "vocab", "key": vocab_key, "vocab_size": int(vocab.vocab_size),
                 "stop_ids": [int(t) for t in vocab.stop_ids]}, protocol.pack_tokens(vocab.token_bytes)))
            self._answer(job, time.monotonic() + VOCAB_LOAD_S, "load the vocabulary")
            self.vocabs.add(vocab_key)
        self._send(protocol.frame({"op": "compile", "key": vocab_key, "kind": job.spec.kind},
                                  job.spec.source.encode()))
        header, body = self._answer(job, time.monotonic() + job.budget_s, f"compile within {job.budget_s:g} s; simplify the schema "
                                                                                "(fewer optional properties, alternatives or bounds)")
        if not protocol.field(header, "ok", bool):
            raise _Refused(protocol.field(header, "error", str))
        return body.decode(), float(protocol.field(header, "ms", (int, float)))

    def _send(self, data: bytes) -> None:
        try:
            self.conn.send_bytes(data)
        except OSError:  # the process died
            self.dead = True
            raise CompileFailed("the grammar compiler stopped") from None

    def _answer(self, job: CompileJob, deadline: float, what: str) -> tuple[dict[str, Any], bytes]:
        """The process's next frame, waiting until `deadline` unless the job is cancelled first (or the process
        grows past its memory limit)."""
        most_mb = limits.compile_memory_mb()
        while not self.conn.poll(POLL_S):
            if job.cancelled:
                raise CompileCancelled("the compile was cancelled: no request waits for it any more")
            if time.monotonic() > deadline:
                raise CompileFailed(f"the grammar did not {what}")
            if self.resident_mb() > most_mb:
                raise CompileFailed(f"the grammar needed more than {most_mb} MB to compile; simplify the schema")
        try:
            return protocol.unframe(self.conn.recv_bytes(protocol.MAX_FRAME_BYTES))
        except (EOFError, OSError):  # the process died (a crash in the library): its socket closed
            self.dead = True
            raise CompileFailed("the grammar compiler stopped (the grammar is too complex to compile)") from None

    def resident_mb(self) -> float:
        """The process's resident memory (0 where /proc cannot tell)."""
        try:
            with open(f"/proc/{self.pid}/statm") as f:
                return int(f.read().split()[1]) * _PAGE / 2**20
        except (OSError, ValueError, IndexError):
            return 0.0

    def kill(self) -> None:
        if not self.dead:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)  # the zygote reaps it
            self.dead = True
        self.conn.close()


class _Refused(CompileFailed):
    """The library refused the grammar: the process is fine and keeps serving."""


class CompilePool:
    """Bounded compiles: `submit` a job (or join the same one in flight), `release` it when its waiter leaves."""

    def __init__(self, workers: int | None = None, queue_size: int | None = None):
        self.workers = workers or limits.compile_workers()
        self.queue_size = queue_size or limits.compile_queue()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._waiting: deque[CompileJob] = deque()  # jobs no process has taken yet
        self._inflight: dict[tuple[str, str], CompileJob] = {}
        self._threads: list[threading.Thread] = []
        self._procs: list[_Worker | None] = []
        self._zygote = _ZYGOTE
        #: Processes killed (a budget overrun or a cancelled compile), for tests and reports.
        self.killed = 0

    def submit(self, key: tuple[str, str], vocab: GrammarVocab, spec: GrammarSpec, budget_s: float,
               param: str | None = None) -> CompileJob:
        """The job compiling `spec` (joined if one is in flight): `CompileQueueFull` when none can wait."""
        with self._lock:
            self._start()
            job = self._inflight.get(key)
            if job is not None and not job.cancelled:
                job.waiters += 1
                return job
            if len(self._waiting) >= self.queue_size:
                raise CompileQueueFull(f"every grammar compiler is busy and {self.queue_size} compiles wait already; "
                                       "retry shortly", retry_after_s=budget_s, param=param)
            job = CompileJob(key, vocab, spec, budget_s)
            self._waiting.append(job)
            self._inflight[key] = job
            self._ready.notify()
            return job

    def release(self, job: CompileJob) -> None:
        """One waiter left: the last one's leaving cancels the job (its process is killed if it is running)."""
        with self._lock:
            job.waiters -= 1
            if job.waiters > 0 or job.future.done():
                return
            job.cancelled = True
            if self._inflight.get(job.key) is job:
                del self._inflight[job.key]
            if job in self._waiting:  # no process took it yet: its place in the queue is free at once
                self._waiting.remove(job)
                job.future.cancel()

    def warm(self) -> None:
        """Start the threads and the zygote now (in a pool thread), so the first request does not wait for them."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        if self._threads:
            return
        self._procs = [None] * self.workers
        for slot in range(self.workers):
            thread = threading.Thread(target=self._serve, args=(slot,), daemon=True, name=f"mstar-grammar-{slot}")
            thread.start()
            self._threads.append(thread)

    def _serve(self, slot: int) -> None:
        if slot == 0:  # the zygote's parent-death signal follows the thread that started it: a thread that lives
            try:  # as long as the server does
                self._zygote.ensure()
            except Exception:
                log.exception("the grammar zygote did not start (compiles will try again)")
        while True:
            with self._ready:
                while not self._waiting:
                    self._ready.wait()
                job = self._waiting.popleft()
                job.future.set_running_or_notify_cancel()
            try:
                job.future.set_result(self._run(slot, job))
            except RequestError as exc:
                job.future.set_exception(exc)
            except Exception as exc:  # the process could not be started or spoke nonsense: this job fails alone
                log.exception("grammar compile process failed")
                self._kill(slot)
                job.future.set_exception(CompileFailed(f"the grammar compiler failed: {type(exc).__name__}"))
            finally:
                with self._lock:
                    if self._inflight.get(job.key) is job:
                        del self._inflight[job.key]

    def _run(self, slot: int, job: CompileJob) -> tuple[str, float]:
        proc = self._procs[slot]
        if proc is None or not proc.alive:
            proc = self._procs[slot] = _Worker(self._zygote)
        try:
            return proc.compile(job.key[0], job)
        except _Refused:
            raise
        except RequestError:
            self._kill(slot)  # past its budget, cancelled, or dead already: the next job gets a fresh process
            raise

    def _kill(self, slot: int) -> None:
        proc, self._procs[slot] = self._procs[slot], None
        if proc is not None:
            self.killed += 1
            proc.kill()

    def busy(self) -> int:
        """Jobs waiting or running (for tests and reports)."""
        with self._lock:
            return len(self._inflight)
