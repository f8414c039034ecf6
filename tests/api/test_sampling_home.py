"""Sampling fields live in one home (`mstar_core.sampling.SAMPLING_FIELDS`): the OpenAI bodies, the realtime and
transcription checks, the model schemas and the adapters read their bounds, defaults and names from it; a model's
defaults merge in one place; `max_tokens` is fitted to the context by one rule."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from mstar_core.api.realtime import config as realtime_config
from mstar_core.api.realtime.protocol import EventError
from mstar_core.api.requests.chat_adapter import SAMPLING_FIELDS as FORWARDED
from mstar_core.api.requests.schemas import ChatRequest, CompletionRequest, ResponsesRequest
from mstar_core.errors import RequestError
from mstar_core.sampling import (
    SAMPLING_FIELDS,
    SamplingDefaults,
    SamplingParams,
    check_openai,
    fit_max_tokens,
    sampling_names,
)
from mstar_core.schema import sampling_field

API = Path(__file__).resolve().parents[2] / "mstar_core" / "api"
PYDANTIC_KEYS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


@pytest.mark.parametrize("body", [ChatRequest, CompletionRequest, ResponsesRequest])
def test_the_openai_bodies_take_their_bounds_from_the_declaration(body):
    properties = body.model_json_schema()["properties"]
    routes_name = {"max_output_tokens": "max_tokens", "max_completion_tokens": "max_tokens"}
    checked = 0
    for field, prop in properties.items():
        name = routes_name.get(field, field)
        if name not in SAMPLING_FIELDS or name == "logprobs":  # `logprobs` is a flag or a count on these routes
            continue
        bounds = SAMPLING_FIELDS[name].openai or {}
        shown = next((p for p in prop.get("anyOf", [prop]) if p.get("type") != "null"), prop)
        for key, value in bounds.items():
            assert shown[PYDANTIC_KEYS[key]] == value, (body.__name__, field, key)
        checked += 1
    assert checked >= 3


def test_temperature_bound_is_written_once():
    # OpenAI's `temperature <= 2` was written in four places; now only the declaration holds it
    pattern = re.compile(r"le=2\.0|<= ?2(\.0)?\b|\[0, 2\]")
    offenders = [str(p.relative_to(API)) for p in API.rglob("*.py") if pattern.search(p.read_text())]
    assert not offenders, offenders
    assert SAMPLING_FIELDS["temperature"].openai == {"ge": 0.0, "le": 2.0}


def test_realtime_and_transcriptions_check_against_the_declaration():
    assert realtime_config.temperature(1.5, "session.temperature") == 1.5
    assert realtime_config.temperature(None, "session.temperature") is None
    with pytest.raises(EventError, match=r"'session\.temperature' must be in \[0, 2\]"):
        realtime_config.temperature(2.5, "session.temperature")
    with pytest.raises(EventError, match="must be a number"):
        realtime_config.temperature(True, "session.temperature")
    with pytest.raises(RequestError, match=r"'temperature' must be in \[0, 2\]"):
        check_openai("temperature", 3.0)


def test_names_are_checked_against_the_declaration():
    assert set(FORWARDED) == {"max_tokens", "temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty",
                              "presence_penalty", "frequency_penalty", "logit_bias", "grammar", "ignore_eos"}
    assert sampling_names("top_p", "seed") == ("top_p", "seed")
    with pytest.raises(ValueError, match="unknown fields"):
        sampling_names("top_q")
    # the model schemas document the same field the engine checks
    assert sampling_field("top_p").json_extra == dict(SAMPLING_FIELDS["top_p"].json_schema)


def test_model_defaults_merge_under_what_the_request_set():
    defaults = SamplingDefaults.from_generation_config({"temperature": 0.7, "top_p": 0.8, "max_new_tokens": 64,
                                                       "do_sample": True, "eos_token_id": 2})
    assert defaults.values == {"temperature": 0.7, "top_p": 0.8, "max_tokens": 64}
    params = SamplingParams.from_mapping({"top_p": 0.5, "temperature": None}, defaults)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.7, 0.5, 64)
    assert SamplingDefaults.from_generation_config({"temperature": 0.9, "do_sample": False}).values == {
        "temperature": 0.0}
    with pytest.raises(RequestError):
        SamplingDefaults({"temperature": -1})
    with pytest.raises(ValueError, match="unknown field"):
        SamplingDefaults({"beam_width": 4})


def test_max_tokens_fits_the_context_by_one_rule():
    default = SamplingParams().max_tokens
    assert fit_max_tokens(None, 10, 10_000) == default
    assert fit_max_tokens(50, 10, 100) == 50
    assert fit_max_tokens(500, 10, 100) == 90
    assert fit_max_tokens(None, 99, 100, default=32) == 1
