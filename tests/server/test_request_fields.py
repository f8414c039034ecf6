"""One path for request checks (issue 26.3): adapters rename, the model's schema declares and checks, the routes
read what they offer from it; `draws_n` is declared, not guessed (the guess warns for one minor version)."""

from __future__ import annotations

import types

import pytest

from mstar_core.api.http.errors import ApiError
from mstar_core.api.requests.adapters import ApiAdapter, api_named, describe_routes
from mstar_core.api.requests.choices import forks_choices
from mstar_core.compat import PluginAPIWarning
from mstar_core.errors import RequestError
from mstar_core.sampling import MAX_SEED, choice_seed
from mstar_core.schema import RequestField, RequestSchema


class Speech(ApiAdapter):
    model = "m"
    routes = {"speech", "images"}
    request_fields = {"speech": {"input": "text", "voice": "speaker"}, "images": {"size": "width"}}


def _bound(schema: RequestSchema) -> Speech:
    adapter = Speech()
    adapter.bind(types.SimpleNamespace(request_schema=schema))
    return adapter


SCHEMA = RequestSchema(fields=(
    RequestField("text", "string", required=True),
    RequestField("speaker", "string", default="b", choices=("b", "a")),
    RequestField("width", "integer", default=256, minimum=16, maximum=1024, multiple_of=16),
    RequestField("height", "integer", default=256, minimum=16, maximum=1024, multiple_of=16),
    RequestField("seed", "integer", minimum=0),
))


def test_an_adapter_renames_and_the_schema_declares():
    adapter = _bound(SCHEMA)
    body = {"model": "m", "input": "hi", "voice": "a", "seed": 3, "response_format": "mp3", "user": None}
    assert adapter.speech_inputs(body) == {"text": "hi", "speaker": "a", "seed": 3}
    assert adapter.voices == ("b", "a") and adapter.field_default("speech", "voice") == "b"
    assert adapter.model_field("speech", "speed") is None  # the route refuses speed by this
    with pytest.raises(RequestError) as err:
        SCHEMA.validate(adapter.speech_inputs({"input": "hi", "voice": "zed"}))
    api = api_named(ApiError(400, str(err.value), param=err.value.param), adapter, "speech")
    assert api.param == "voice" and "choose one of b, a" in api.message


def test_sizes_and_their_rule_come_from_the_declared_fields():
    described = describe_routes({"images": _bound(SCHEMA)})
    assert described["image_sizes"] == ["256x256", "512x512", "1024x1024"]
    assert described["default_image_size"] == "256x256" and "multiple of 16 from 16 to 1024" in described["image_size_rule"]
    with pytest.raises(RequestError, match="multiple of 16"):
        SCHEMA.field("width").convert(520)


def test_drawing_n_is_declared_and_the_old_guess_warns():
    n = RequestField("n", "integer", default=1, minimum=1, maximum=4)
    assert forks_choices(_bound(RequestSchema(fields=(n,), draws_n=True)))
    assert not forks_choices(_bound(RequestSchema(fields=(RequestField("x", "integer"),))))
    with pytest.warns(PluginAPIWarning, match="draws_n=True"):
        assert forks_choices(_bound(RequestSchema(fields=(n,))))
    with pytest.raises(ValueError, match="integer field 'n'"):
        RequestSchema(fields=(RequestField("x", "integer"),), draws_n=True)


def test_one_rule_for_per_output_seeds():
    assert [choice_seed(5, i) for i in range(3)] == [5, 6, 7] and choice_seed(None, 2) is None
    assert choice_seed(MAX_SEED, 1) == 0
