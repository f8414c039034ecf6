"""Declared request schemas (`mstar_core.schema`): one declaration checks a request with uniform messages naming
the field, fills defaults, and documents the fields as JSON Schema."""

from __future__ import annotations

import pytest
import torch

from mstar_core.errors import RequestError
from mstar_core.graph import Graph, GraphNode, Walk
from mstar_core.model import LoadedModel
from mstar_core.schema import RequestField, RequestSchema, sampling_field, sampling_fields

SCHEMA = RequestSchema(
    fields=(
        RequestField("text", "string", "what to say", required=True, blank=False, max_length=20),
        RequestField("voice", "string", "speaker", default="tara", choices=("tara", "leo")),
        RequestField("steps", "integer", "how many", default=4, minimum=1, maximum=8),
        RequestField("scale", "number", "guidance", minimum=0, exclusive_minimum=True, maximum=10),
        RequestField("loud", "boolean", default=False),
        RequestField("ids", "array", "token ids", items="integer", min_length=1),
        RequestField("image", "tensor", "pixels", check=lambda t, name: t.float()),
        *sampling_fields("temperature", "seed", defaults={"temperature": 0.7}),
    ),
    example={"text": "hi"},
)


def test_valid_request_is_converted_and_defaults_filled():
    out = SCHEMA.validate({"text": "hi", "scale": 2, "ids": [1, 2], "image": [[1, 2]], "seed": 3, "loud": None})
    assert out == {"text": "hi", "voice": "tara", "steps": 4, "scale": 2.0, "loud": False, "ids": [1, 2],
                   "image": out["image"], "temperature": 0.7, "seed": 3}
    assert out["image"].dtype == torch.float32 and out["image"].shape == (1, 2)
    assert SCHEMA.validate({"text": "hi"}) == {"text": "hi", "voice": "tara", "steps": 4, "loud": False,
                                               "temperature": 0.7}


@pytest.mark.parametrize(
    ("inputs", "param", "match"),
    [
        ({"text": "hi", "txet": 1}, "txet", r"unknown field\(s\) \['txet'\] \(did you mean 'txet' -> 'text'\?\); "
                                            r"known fields: \['text', 'voice'"),
        ({}, "text", "missing field 'text': what to say"),
        ({"text": None}, "text", "missing field 'text'"),
        ({"text": "  "}, "text", "'text' must be a non-empty string"),
        ({"text": 3}, "text", "'text' must be a non-empty string of at most 20 characters, got 3"),
        ({"text": "x" * 21}, "text", "'text' must be a string of at most 20 characters, got 21"),
        ({"text": "a", "voice": "bob"}, "voice", "unknown voice 'bob'; choose one of tara, leo"),
        ({"text": "a", "steps": 9}, "steps", r"'steps' must be an integer in \[1, 8\], got 9"),
        ({"text": "a", "steps": 2.0}, "steps", "'steps' must be an integer"),
        ({"text": "a", "steps": True}, "steps", "'steps' must be an integer"),
        ({"text": "a", "scale": 0}, "scale", r"'scale' must be in \(0, 10\], got 0"),
        ({"text": "a", "scale": float("nan")}, "scale", "'scale' must be a finite number"),
        ({"text": "a", "loud": "yes"}, "loud", "'loud' must be true or false, got 'yes'"),
        ({"text": "a", "ids": []}, "ids", "'ids' must be a non-empty list of integers"),
        ({"text": "a", "ids": "abc"}, "ids", "'ids' must be a non-empty list of integers"),
        ({"text": "a", "ids": [1, 1.5]}, "ids", r"'ids\[1\]' must be an integer, got 1.5"),
        ({"text": "a", "image": "abc"}, "image", "'image' must be a tensor"),
        ({"text": "a", "image": [[1], [1, 2]]}, "image", "rectangular list of numbers"),
        ({"text": "a", "seed": -1}, "seed", r"'seed' must be an integer in \[0, 2\*\*63 - 1\]"),
        ({"text": "a", "temperature": 1e-9}, "temperature", "'temperature' must be 0 .greedy."),
    ],
)
def test_bad_requests_name_the_field(inputs, param, match):
    with pytest.raises(RequestError, match=match) as info:
        SCHEMA.validate(inputs)
    assert info.value.param == param and info.value.status == 400


def test_not_an_object_and_exactly_one_of():
    with pytest.raises(RequestError, match="request inputs must be an object, got list"):
        SCHEMA.validate([1])
    schema = RequestSchema(fields=(RequestField("prompt", "string"), RequestField("ids", "array")),
                           exactly_one_of=[("prompt", "ids")])
    for inputs, got in [({}, "none"), ({"prompt": "a", "ids": [1]}, r"\['prompt', 'ids'\]")]:
        with pytest.raises(RequestError, match=rf"send exactly one of \['prompt', 'ids'\], got {got}"):
            schema.validate(inputs)
    assert schema.validate({"ids": [1], "prompt": None}) == {"ids": [1]}
    assert RequestSchema(fields=(), allow_extra=True).validate({"x": 1}) == {"x": 1}


def test_declaration_errors():
    with pytest.raises(ValueError, match="unknown kind 'str'"):
        RequestField("a", "str")
    with pytest.raises(ValueError, match="a required field has no default"):
        RequestField("a", "string", required=True, default="x")
    with pytest.raises(ValueError, match=r"duplicate fields \['a'\]"):
        RequestSchema(fields=(RequestField("a"), RequestField("a")))
    with pytest.raises(ValueError, match=r"undeclared fields \['b'\]"):
        RequestSchema(fields=(RequestField("a"),), exactly_one_of=[("a", "b")])
    with pytest.raises(ValueError, match="unknown field 'tempreature'"):
        sampling_field("tempreature")


def test_json_schema_documents_every_field():
    doc = SCHEMA.json_schema()
    assert doc["required"] == ["text"] and doc["additionalProperties"] is False
    props = doc["properties"]
    assert props["text"] == {"type": "string", "description": "what to say", "maxLength": 20}
    assert props["voice"]["enum"] == ["tara", "leo"] and props["voice"]["default"] == "tara"
    assert props["steps"] == {"type": "integer", "description": "how many", "default": 4, "minimum": 1, "maximum": 8}
    assert props["scale"]["exclusiveMinimum"] == 0 and props["ids"]["items"] == {"type": "integer"}
    assert props["seed"]["maximum"] == 2**63 - 1 and props["temperature"]["default"] == 0.7
    assert {"$ref": "#/components/schemas/Tensor"} in props["image"]["anyOf"]
    assert doc["examples"] == [{"text": "hi"}]


def test_loaded_model_checks_the_schema_before_prepare():
    graph = Graph.build("m", [GraphNode("f", inputs="text", outputs="y", engine="function", module=lambda: str)],
                        [Walk(name="w", body="f", inputs="text", outputs="y")])
    seen = []
    loaded = LoadedModel("m", graph, prepare=lambda inputs: seen.append(dict(inputs)) or dict(inputs),
                         request_schema=SCHEMA)
    with pytest.raises(RequestError, match="unknown field"):
        loaded.prepare_inputs({"text": "a", "nope": 1})
    assert seen == []
    assert loaded.prepare_inputs({"text": "a"})["voice"] == "tara" and seen[0]["steps"] == 4
    assert loaded.example == {"text": "hi"}
    assert LoadedModel("m", graph).example is None
