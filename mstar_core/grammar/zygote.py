"""The compile processes' parent: a process that imports xgrammar once and forks a compile process on request.

Importing xgrammar (and the torch it imports) takes seconds and ~300 MB; a fork of a process that already did
takes tens of milliseconds and shares those pages, so a compile process killed mid-compile is replaced at once.
The server starts this process (`python -m mstar_core.grammar.zygote FD`) and asks it for processes over a Unix
socket: it sends one end of a fresh socket pair, and the fork serves `worker.serve` on it; the reply is the pid
(to kill it by). Nothing is pickled, and the server needs no multiprocessing machinery (which would re-import its
`__main__` in every child).

This process ends when the server does (its socket closes, or the kernel's parent-death signal), and its forks
with it; the kernel reaps them.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import sys
from multiprocessing.connection import Connection

PID = struct.Struct("<i")


#: Added to the compile processes' niceness (0 is the server's).
COMPILE_NICENESS = 10


def main(fd: int) -> None:
    from mstar_core.grammar import worker  # xgrammar imported here, once, before any fork

    worker.die_with_parent()
    # compiles (and so every fork) run below the server's priority: on a busy machine the serving process (its
    # event loop, the engine) gets the cores first, and a compile that then runs past its budget is the one refused
    os.nice(COMPILE_NICENESS)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # forks that end are reaped by the kernel
    ctrl = socket.socket(fileno=fd)
    ctrl.sendall(b"R")  # ready
    while True:
        try:
            msg, fds, _flags, _addr = socket.recv_fds(ctrl, 16, 1)
        except OSError:
            return
        if not msg:
            return  # the server closed its end
        if len(fds) != 1:
            for extra in fds:
                os.close(extra)
            return
        pid = os.fork()
        if pid == 0:
            ctrl.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            code = 0
            try:
                worker.serve(Connection(fds[0]))
            except BaseException:
                code = 1
            os._exit(code)
        os.close(fds[0])
        ctrl.sendall(PID.pack(pid))


if __name__ == "__main__":
    main(int(sys.argv[1]))
