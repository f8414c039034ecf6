"""Shared fixtures: a tiny random HF Llama written in HF layout and loaded back through M*'s loader."""

from __future__ import annotations

import os

import pytest

# the kvcache tests import these names from here; new code imports tests.engines.helpers
from tests.engines.helpers import TINY, hf_greedy, make_pair  # noqa: F401

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("tiny_llama"))
