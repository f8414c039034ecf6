"""Pieces without a server: incremental detokenization, the tensor JSON codec, audio encoders, deploy files."""

from __future__ import annotations

import base64
import io
import struct

import numpy as np
import pytest
import soundfile
import torch

from mstar_core.api.media.audio import AudioEncoder
from mstar_core.api.media.tensors import DTYPES, decode_inputs, encode_value
from mstar_core.api.requests.adapters import ApiAdapter, to_int16_pcm
from mstar_core.api.requests.text import TextAssembler
from mstar_core.api.server.deploy import load_deploy
from mstar_core.errors import ConfigError, RequestError


class ByteAdapter(ApiAdapter):
    """Token id = one UTF-8 byte; 999 = EOS."""

    def detokenize(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")

    def is_stop_token(self, token_id):
        return token_id == 999


def run(text: str, stops=(), max_tokens=None, eos=True):
    asm = TextAssembler(ByteAdapter(), stops, max_tokens)
    pieces = [asm.feed(b) for b in text.encode()] + ([asm.feed(999)] if eos else [])
    pieces.append(asm.close({}))
    return pieces, asm


def test_multibyte_characters_are_never_split():
    pieces, asm = run("aé✓b")
    assert "".join(pieces) == "aé✓b" and all("\ufffd" not in p for p in pieces)
    assert asm.finish_reason == "stop" and asm.generated == len("aé✓b".encode()) + 1


def test_stop_string_across_tokens_is_held_back_and_cut():
    pieces, asm = run("hello STOP world", stops=["STOP"])
    assert "".join(pieces) == "hello " and asm.finish_reason == "stop" and asm.text == "hello "
    assert not any("ST" in p for p in pieces)
    pieces, asm = run("a STx", stops=["STOP"])  # a prefix that never completes is released
    assert "".join(pieces) == "a STx"


def test_max_tokens_gives_length():
    pieces, asm = run("abcdef", max_tokens=4, eos=False)
    assert "".join(pieces) == "abcd" and asm.finish_reason == "length" and asm.generated == 4


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_tensor_codec_round_trips_every_dtype(dtype):
    t = (torch.arange(24) % 5).reshape(2, 3, 4).to(DTYPES[dtype])
    back = decode_inputs({"a": [encode_value(t)]})["a"][0]
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)


def test_tensor_codec_rejects_bad_tensors_by_name():
    good = encode_value(torch.zeros(2, 2))
    with pytest.raises(RequestError, match=r"'inputs\.x\.dtype'"):
        decode_inputs({"x": {**good, "dtype": "complex7"}})
    with pytest.raises(RequestError, match=r"'inputs\.x\.data' has 4 bytes"):
        decode_inputs({"x": {**good, "data": base64.b64encode(b"1234").decode()}})
    with pytest.raises(RequestError, match="base64"):
        decode_inputs({"x": {**good, "data": "***"}})


def test_audio_encoders():
    pcm = to_int16_pcm(torch.tensor([0.0, 0.5, -1.0, 2.0]))
    assert pcm.tolist() == [0, 16384, -32767, 32767]
    enc = AudioEncoder("wav", 8000, stream=True)
    data = enc.chunk(pcm) + enc.chunk(pcm) + enc.finish()
    assert struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF and np.frombuffer(data[44:], "<i2").tolist() == pcm.tolist() * 2
    enc = AudioEncoder("wav", 8000, stream=False)
    assert enc.chunk(pcm) == b""
    audio, rate = soundfile.read(io.BytesIO(enc.finish()), dtype="int16")
    assert rate == 8000 and audio.tolist() == pcm.tolist()
    enc = AudioEncoder("flac", 8000, stream=False)  # buffered: exact sizes in the header
    assert enc.chunk(pcm) == b""
    audio, rate = soundfile.read(io.BytesIO(enc.finish()), dtype="int16")
    assert rate == 8000 and audio.tolist() == pcm.tolist()


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(("fmt", "rate", "lossless"), [("flac", 24000, True), ("mp3", 24000, False),
                                                        ("opus", 48000, False), ("aac", 24000, False)])
def test_codec_encoders_decode_back(fmt, rate, lossless, stream):
    """Each FFmpeg-encoded format, streamed in model-sized chunks or buffered, decodes (PyAV) to the same length."""
    av = pytest.importorskip("av")
    t = np.arange(24000 * 3 // 2) / 24000
    pcm = (np.sin(2 * np.pi * 440 * t) * 12000).astype(np.int16)
    enc = AudioEncoder(fmt, 24000, stream=stream)
    pieces = [enc.chunk(pcm[i:i + 2048]) for i in range(0, pcm.size, 2048)]
    data = b"".join(pieces) + enc.finish()
    assert any(pieces) == stream  # streamed bytes leave before the end; buffered ones only at finish
    with av.open(io.BytesIO(data)) as container:
        stream_in = container.streams.audio[0]
        decoded = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(stream_in)])
        assert stream_in.codec_context.sample_rate == rate  # Opus decodes at its own 48 kHz
    seconds = decoded.size / rate
    assert abs(seconds - 1.5) < 0.1, seconds  # codec priming and padding: a few ms, never a missing chunk
    if lossless:
        assert decoded.astype(np.int16).tolist() == pcm.tolist()


def test_deploy_file_is_strict(tmp_path):
    good = tmp_path / "ok.yaml"
    good.write_text("server: {port: 9000, max_running: 8}\nmodels:\n  orpheus: {preset: tiny, engines: {lm: {num_pages: 64}}}\n")
    server, models = load_deploy(good)
    assert server == {"port": 9000, "max_running": 8}
    assert models["orpheus"].options.preset == "tiny" and models["orpheus"].settings == {"lm": {"num_pages": 64}}
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  orpheus: {presett: tiny}\n")
    with pytest.raises(ConfigError, match="presett"):
        load_deploy(bad)
    bad.write_text("server: {prot: 1}\n")
    with pytest.raises(ConfigError, match="prot"):
        load_deploy(bad)


def test_metrics_label_only_loaded_models():
    import types

    from mstar_core.api.server.metrics import Metrics

    metrics = Metrics(types.SimpleNamespace(models={"orpheus": object()}))
    metrics.observe_request("orpheus", "speech", 200, 0.1)
    for junk in ("nope", "x" * 1000, "e\u2028vil"):  # client-chosen names must not become label values
        metrics.observe_request(junk, "speech", 404)
    text = metrics.render().decode()
    assert 'model="orpheus",route="speech",status="200"' in text
    assert 'mstar_requests_total{model="unknown",route="speech",status="404"} 3.0' in text
    assert "nope" not in text and "vil" not in text


def test_torch_threads_server_option_reaches_the_engine_and_is_checked(tmp_path):
    from mstar_core.api.server.app import ServerConfig
    from mstar_core.api.server.deploy import apply_server_options
    from mstar_core.api.server.launch import serving_engine

    deploy = tmp_path / "threads.yaml"
    deploy.write_text("server: {torch_threads: 1}\nmodels:\n  orpheus: {preset: tiny}\n")
    config = ServerConfig()
    apply_server_options(config, load_deploy(deploy)[0])
    assert config.torch_threads == 1
    before = torch.get_num_threads()
    try:
        assert serving_engine(None, config).torch_threads == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)  # (the engine sets this process's pool)
    assert serving_engine(None, ServerConfig()).torch_threads == "share"  # default: the cores, shared with workers
    for bad in (0, -2, "two", True):
        with pytest.raises(ConfigError, match="torch_threads"):
            apply_server_options(ServerConfig(), {"torch_threads": bad})


def test_dtype_flag_sets_every_models_dtype_over_the_deploy_file(tmp_path):
    import argparse

    from mstar_core.api.server.launch import add_arguments, build_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    deploy = tmp_path / "d.yaml"
    deploy.write_text("models:\n  orpheus: {preset: tiny, dtype: float32}\n")
    config, _, _ = build_config(parser.parse_args(["llama", "--checkpoint", "/x", "--dtype", "bfloat16"]))
    assert config.models[0].options.dtype == "bfloat16" and config.models[0].options.checkpoint == "/x"
    config, _, _ = build_config(parser.parse_args(["--config", str(deploy), "--dtype", "bfloat16"]))
    assert config.models[0].options.dtype == "bfloat16" and config.models[0].options.preset == "tiny"
    config, _, _ = build_config(parser.parse_args(["--config", str(deploy)]))
    assert config.models[0].options.dtype == "float32"
    assert build_config(parser.parse_args(["llama"]))[0].models[0].options.dtype is None  # the model's default
    with pytest.raises(ConfigError, match="unknown dtype 'fp7'.*bfloat16"):
        build_config(parser.parse_args(["llama", "--dtype", "fp7"]))
