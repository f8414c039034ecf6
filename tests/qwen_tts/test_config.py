"""The published layout loads (config, safetensors, tokenizer, speech_tokenizer/), bad configs name their key, and
the prompt rows follow the upstream layout."""

import copy
import json
from pathlib import Path

import pytest
import torch
from mstar_qwen_tts.config import SpeechDecoderConfig, TTSConfig
from mstar_qwen_tts.prepare import Preparer
from mstar_qwen_tts.prompt import talker_rows

from mstar_core.errors import ConfigError


def _config(tiny_dir):
    return json.loads((tiny_dir / "config.json").read_text())


def test_preset_has_the_published_files(tiny_dir):
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "speech_tokenizer"} <= names
    assert {p.name for p in (tiny_dir / "speech_tokenizer").iterdir()} >= {"config.json", "model.safetensors",
                                                                           "preprocessor_config.json"}


@pytest.mark.parametrize("path,value,key", [
    (("talker_config", "code_predictor_config", "num_code_groups"), 5, "code_predictor_config.num_code_groups"),
    (("talker_config", "spk_id", "ryan"), 9999, "spk_id.ryan"),
    (("talker_config", "spk_is_dialect", "eric"), "martian", "spk_is_dialect.eric"),
    (("talker_config", "rope_scaling", "mrope_section"), [4, 4, 4], "mrope_section"),
    (("tts_model_type",), "karaoke", "tts_model_type"),
    (("talker_config", "hidden_size"), "wide", "talker_config.hidden_size"),
])
def test_bad_config_names_the_key(tiny_dir, path, value, key):
    cfg = copy.deepcopy(_config(tiny_dir))
    node = cfg
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        TTSConfig.from_hf(cfg)


def test_speech_tokenizer_rate_must_match_its_upsampling(tiny_dir):
    cfg = json.loads((tiny_dir / "speech_tokenizer" / "config.json").read_text())
    assert SpeechDecoderConfig.from_hf(cfg).samples_per_frame == 1920
    with pytest.raises(ConfigError, match="decode_upsample_rate"):
        SpeechDecoderConfig.from_hf({**cfg, "decode_upsample_rate": 8})


def test_prompt_rows_follow_the_upstream_layout(tts, tokenizer):
    cfg, talker = tts.config, tts.talker
    prep = Preparer(cfg, tokenizer)
    env = prep({"input": "Hello there!", "voice": "ryan", "language": "english", "non_streaming_mode": False,
                "max_frames": 8, "do_sample": False, "temperature": 0.9, "top_k": 50, "top_p": 1.0,
                "repetition_penalty": 1.05, "subtalker_dosample": False, "subtalker_temperature": 0.9,
                "subtalker_top_k": 50, "subtalker_top_p": 1.0})
    ids = env["text_ids"]
    pre, trailing = talker_rows(talker, cfg, ids, [], "ryan", "english", False)
    # role (3) + [think, think_bos, english, think_eos, ryan, pad] + (first text token + bos)
    assert pre.shape[0] == 3 + 6 + 1
    assert trailing.shape[0] == len(ids) - 9 + 2  # the rest of the text, tts_eos, then tts_pad (repeated)
    pad = talker.text_rows(torch.tensor([cfg.tts_pad_token_id]))[0]
    assert torch.allclose(trailing[-1], pad)
    lang = talker.embed(torch.tensor(cfg.talker.codec_language_id["english"]))
    assert torch.allclose(pre[5], pad + lang)
    non_streaming, trailing = talker_rows(talker, cfg, ids, [], "ryan", "english", True)
    # role + prefix + every text token and tts_eos over codec pad + (tts_pad over codec bos)
    assert non_streaming.shape[0] == 3 + 6 + (len(ids) - 8 + 1) + 1 and trailing.shape[0] == 1


def test_graph_file_is_small():
    import mstar_qwen_tts.graph as graph

    assert len(Path(graph.__file__).read_text().splitlines()) <= 300
