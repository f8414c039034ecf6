"""benchmarks/llamacpp_side.py and vs_llamacpp.py's floor: the settings llama.cpp gets and the bytes a step reads."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import llamacpp_side
import vs_llamacpp


def test_server_gets_a_slot_per_request_and_every_core():
    cmd = llamacpp_side.server_command(Path("/b/llama-server"), Path("/m.gguf"), 8123, slots=32, ctx_per_slot=512,
                                       threads=2)
    args = dict(zip(cmd[1::2], cmd[2::2], strict=False))
    assert cmd[0] == "/b/llama-server"
    assert args["--parallel"] == "32" and args["--ctx-size"] == str(32 * 512)
    assert args["--threads"] == "2" and args["--threads-batch"] == "2"
    assert args["--alias"] == "llama" and args["--port"] == "8123"


def test_weight_bytes_count_every_parameter_once_in_the_served_dtype(tmp_path):
    save_file({"a": torch.zeros(3, 5), "b": torch.zeros(7)}, str(tmp_path / "model-00001.safetensors"))
    save_file({"c": torch.zeros(2, 2, 2, dtype=torch.bfloat16)}, str(tmp_path / "model-00002.safetensors"))
    params = 15 + 7 + 8
    assert vs_llamacpp.weight_bytes(tmp_path, "float32") == params * 4
    assert vs_llamacpp.weight_bytes(tmp_path, "bfloat16") == params * 2


def test_read_bandwidth_is_a_rate():
    gb_s = vs_llamacpp.read_bandwidth_gb_s(8 << 20, reads=3)
    assert 0.1 < gb_s < 10_000
