"""The tiny preset through the real-checkpoint loaders, and Orpheus end to end on the kvcache + stateless engines."""

import asyncio
import json

import pytest
import torch
from mstar_orpheus.codes import AudioTokenMap, reference_audio
from mstar_orpheus.model import load_orpheus
from mstar_orpheus.preset import TINY_SNAC, random_lm_state, tiny_lm_config, write_tiny
from mstar_orpheus.prompt import VOICES
from mstar_orpheus.snac import SNACCheckpointError
from safetensors.torch import load_file, save_file

from mstar_core.checkpoint import CheckpointError
from mstar_core.errors import ConfigError, RequestError
from mstar_core.model import LoadOptions
from mstar_core.runtime import AsyncEngine
from tests.orpheus.helpers import collect


def test_tiny_preset_round_trips_through_the_loaders(tmp_path):
    write_tiny(tmp_path, seed=5)
    assert (tmp_path / "model.safetensors.index.json").is_file() and (tmp_path / "snac" / "config.json").is_file()
    loaded = load_orpheus(LoadOptions(checkpoint=str(tmp_path)), progress=False)
    assert loaded.random_weights is False  # a checkpoint dir is served as what it is
    lm = loaded.graph.nodes["lm"].module()
    tok = loaded.extras["tokenizer"]
    vocab = loaded.extras["vocab"]
    expected = random_lm_state(tiny_lm_config(tok), vocab.audio, seed=5)
    got = lm.state_dict()
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    assert vocab.audio.codebook_size == TINY_SNAC.codebook_size and vocab.audio.end == lm.config.vocab_size
    assert tok.token_to_id("<custom_token_2>") == vocab.end_of_speech
    assert loaded.extras["sample_rate"] == 24000


def _drop_tensor(directory, name):
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shard = directory / index["weight_map"].pop(name)
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard))
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def test_missing_lm_tensor_is_named(tmp_path):
    write_tiny(tmp_path)
    _drop_tensor(tmp_path, "model.layers.1.mlp.down_proj.weight")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_orpheus(LoadOptions(checkpoint=str(tmp_path)), progress=False)


def test_missing_snac_tensor_is_named(tmp_path):
    write_tiny(tmp_path)
    tensors = load_file(str(tmp_path / "snac" / "model.safetensors"))
    del tensors["quantizer.quantizers.1.codebook.weight"]
    save_file(tensors, str(tmp_path / "snac" / "model.safetensors"))
    with pytest.raises(SNACCheckpointError, match=r"missing tensors: quantizer\.quantizers\.1\.codebook\.weight"):
        load_orpheus(LoadOptions(checkpoint=str(tmp_path)), progress=False)


def test_prepare_builds_the_orpheus_prompt(preset_cache):
    loaded = load_orpheus(LoadOptions(preset="tiny"), progress=False)
    vocab, tok = loaded.extras["vocab"], loaded.extras["tokenizer"]
    env = loaded.prepare_inputs({"text": "Hi <laugh> there", "voice": "leo", "max_tokens": 50})
    body = tok.encode("leo: Hi <laugh> there").ids
    assert env["prompt_ids"] + env["decode_ids"] == [
        vocab.start_of_human, *body, vocab.end_of_text, vocab.end_of_human, vocab.start_of_ai, vocab.start_of_speech
    ]
    s = env["sampling"]
    assert (s.temperature, s.top_p, s.repetition_penalty) == (0.6, 0.8, 1.3)
    assert s.stop_token_ids == (vocab.end_of_speech,) and env["max_tokens"] == 50
    with pytest.raises(RequestError, match="unknown voice 'bob'; choose one of tara, leah"):
        loaded.prepare_inputs({"text": "x", "voice": "bob"})
    with pytest.raises(RequestError, match="'text' must be a non-empty string"):
        loaded.prepare_inputs({"text": " ", "voice": "tara"})
    with pytest.raises(RequestError, match=r"unknown field\(s\) \['pitch'\]"):
        loaded.prepare_inputs({"text": "x", "pitch": 2})


def test_speech_adapter(preset_cache):
    from mstar_core.plugins import discover

    adapters = [a for a in discover().api_adapters if a.model == "orpheus"]
    assert len(adapters) == 1
    adapter = adapters[0]
    loaded = load_orpheus(LoadOptions(preset="tiny"), progress=False)
    adapter.bind(loaded)
    # the adapter only renames; voices come from the request schema, which checks them (once) when prepared
    assert adapter.routes == {"speech"} and adapter.sample_rate == 24000 and adapter.voices == VOICES
    body = {"input": "hello", "voice": "zoe", "seed": 3, "speed": 1.0, "response_format": "wav", "model": "orpheus"}
    assert adapter.speech_inputs(body) == {"text": "hello", "voice": "zoe", "seed": 3}
    assert adapter.api_param("speech", "text") == "input" and adapter.field_default("speech", "voice") == "tara"
    with pytest.raises(RequestError, match="unknown voice 'alloy'") as err:
        loaded.prepare_inputs(adapter.speech_inputs({"input": "hello", "voice": "alloy"}))
    assert err.value.param == "voice"


async def test_streaming_equals_offline_end_to_end(preset_cache):
    """Real LM on the paged-KV engine, SNAC on the stateless engine, three concurrent requests."""
    engine = AsyncEngine()
    loaded = await engine.load_model("orpheus", LoadOptions(preset="tiny"), settings={"lm": {"num_pages": 64}})
    assert loaded.random_weights is True
    audio_map: AudioTokenMap = loaded.extras["vocab"].audio
    snac = loaded.graph.nodes["snac"].module()
    texts = ["Hello there.", "A much longer sentence <laugh> to speak.", "Third."]
    handles = [
        engine.submit("orpheus", {"text": t, "voice": "tara", "max_tokens": 60 + 5 * i, "seed": i})
        for i, t in enumerate(texts)
    ]

    results = await asyncio.gather(*(collect(h) for h in handles))
    for i, (audio, tokens, env) in enumerate(results):
        assert len(tokens) == 60 + 5 * i or tokens[-1] == loaded.extras["vocab"].end_of_speech
        expected = reference_audio(tokens, audio_map, lambda w, s, env=env: snac.decode_window(w, s, env["noise_seed"]))
        kept = sum(audio_map.is_audio(t) for t in tokens)
        assert kept >= 35, "the tiny preset should mostly speak audio tokens"
        assert len(audio) == len(expected) == (kept - 28) // 7 + 1
        assert sum(a.numel() > 0 for a in audio) >= len(audio) - 1, "the preset should emit decodable frames"
        for got, want in zip(audio, expected, strict=True):
            assert got.shape == want.shape and (got.numel() == 0 or (got - want).abs().max().item() <= 1e-5)
    engines = engine.node_engines("orpheus")
    assert engines["lm"].stats()["kv_pages_used"] == 0
    assert not engines["lm"].active_requests() and not engines["snac"].active_requests()
    await engine.close()


async def test_cancel_frees_kv_pages(preset_cache):
    engine = AsyncEngine()
    await engine.load_model("orpheus", LoadOptions(preset="tiny"), settings={"lm": {"num_pages": 64}})
    handle = engine.submit("orpheus", {"text": "Cancel me soon.", "voice": "dan", "max_tokens": 500})
    async for out in handle:
        if out.name == "audio":
            handle.cancel()
            break
    with pytest.raises(RequestError):
        await handle.result()
    await asyncio.sleep(0.05)
    lm = engine.node_engines("orpheus")["lm"]
    assert lm.stats()["kv_pages_used"] == 0 and not lm.active_requests()
    await engine.close()


def test_synthesize_to_wav(preset_cache, tmp_path):
    import wave

    from mstar_orpheus import synthesize_to_wav

    path = synthesize_to_wav(None, "Hello there.", "tara", tmp_path / "speech.wav", progress=False, max_tokens=49, seed=1)
    with wave.open(str(path)) as f:
        assert f.getframerate() == 24000 and f.getsampwidth() == 2 and f.getnchannels() == 1
        # 49 audio tokens -> windows after 28, 35, 42, 49 kept tokens, 16 samples each at the tiny hop of 4
        assert f.getnframes() == 4 * 16


def test_model_is_registered_by_entry_point():
    from mstar_core.plugins import discover

    spec = discover().models.get("orpheus")
    assert spec.presets == ("tiny",)


@torch.no_grad()
def test_preset_lm_is_a_real_hf_llama_checkpoint(tmp_path):
    """`transformers` reads the preset dir as written, and its logits match the loaded M* decoder."""
    transformers = pytest.importorskip("transformers")
    from mstar_core.nn.attention import DenseAttention

    write_tiny(tmp_path, seed=2)
    loaded = load_orpheus(LoadOptions(checkpoint=str(tmp_path)), progress=False)
    env = loaded.prepare_inputs({"text": "Hello <sigh> world", "voice": "mia"})
    ids = torch.tensor(env["prompt_ids"] + env["decode_ids"])
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    expected = hf(ids.unsqueeze(0)).logits[0]
    lm = loaded.graph.nodes["lm"].module()
    got = lm.compute_logits(lm(ids, torch.arange(len(ids)), DenseAttention()))
    assert (got - expected).abs().max().item() <= 1e-4


def test_the_snac_part_loads_from_its_own_checkpoint(tmp_path, monkeypatch):
    """A deploy file's `checkpoint: {model: ..., snac: ...}`: SNAC from the `snac` part's directory (here a Hub id
    resolved through a Hub cache the test writes), not `<checkpoint>/snac/`."""
    import shutil

    from mstar_core.checkpoint.hub import resolve_options
    from tests.checkpoint.hub_cache import cache_repo

    write_tiny(tmp_path / "ckpt", seed=5)
    snac = tmp_path / "ckpt" / "snac"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache_repo(tmp_path / "hub", "hubertsiuzdak/snac_24khz", snac)
    shutil.rmtree(snac)
    with pytest.raises(ConfigError, match="no SNAC codec"):
        load_orpheus(LoadOptions(checkpoint=str(tmp_path / "ckpt")), progress=False)
    options = resolve_options(LoadOptions(checkpoint=str(tmp_path / "ckpt"), parts={"snac": "hubertsiuzdak/snac_24khz"}))
    loaded = load_orpheus(options, progress=False)
    assert loaded.extras["sample_rate"] == 24000 and "snac" in loaded.graph.nodes
