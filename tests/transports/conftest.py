"""Helpers for transport tests: start the peer script as a real second process."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

PEER = pathlib.Path(__file__).with_name("peer.py")


@pytest.fixture
def spawn():
    """spawn(*args) -> Popen running tests/transports/peer.py; killed at teardown if still alive."""
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        p = subprocess.Popen([sys.executable, str(PEER), *args], stdout=subprocess.PIPE, text=True, env=env)
        procs.append(p)
        return p

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)
