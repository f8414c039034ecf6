"""Fuzz what the native endpoint does before a request is queued, in-process, for the models the edge server does
not load (V-JEPA 2 and its AC world model): decode the JSON inputs, check the shared fields, run the model's
`prepare`. Whatever the inputs, the outcome is prepared inputs or an error the server answers with a 4xx."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstar_core.api.media.tensors import decode_inputs, encode_value
from mstar_core.errors import MStarError, RequestError
from mstar_core.model import LoadOptions
from mstar_core.sampling import check_fields
from tests.server.test_edge_fuzz import EDGE_NUMBERS, WRONG_TYPES, junk, mutated, tensor_json

pytest.importorskip("mstar_vjepa")

#: What `mstar_core.api.requests.submit.submit` answers with a 400 when `prepare` raises it; anything else would be a 500.
CLIENT_ERRORS = (RequestError, MStarError, ValueError, TypeError, KeyError, IndexError, OverflowError)


def frames(t: int, size: int, dtype=torch.float32) -> dict:
    return encode_value(torch.rand(t, 3, size, size).to(dtype))


def values(*valid):
    return st.one_of(st.sampled_from(EDGE_NUMBERS), st.sampled_from(WRONG_TYPES), junk, tensor_json(),
                     *(st.just(v) for v in valid))


@pytest.fixture(scope="module")
def models():
    from mstar_vjepa.model import load_vjepa2, load_vjepa2_ac

    return {"vjepa2": load_vjepa2(LoadOptions(preset="tiny")), "vjepa2-ac": load_vjepa2_ac(LoadOptions(preset="tiny"))}


def cases(models):
    ac = models["vjepa2-ac"].extras["encoder_config"].crop_size
    hf = models["vjepa2"].extras["config"].crop_size
    states = encode_value(torch.zeros(1, 7))
    return {
        "vjepa2": ({"walk": "predict", "video": frames(2, hf), "context_mask": [0], "target_mask": [0]},
                   {"walk": values("encode", "predict"), "video": values(frames(2, hf), frames(2, 40, torch.uint8)),
                    "context_mask": values([0], [1]), "target_mask": values([0]), "preprocess": values(True, False)}),
        "vjepa2-ac": ({"walk": "plan", "frames": frames(1, ac), "states": states, "goal": frames(1, ac), "horizon": 1,
                       "samples": 4, "topk": 2, "iterations": 1, "seed": 3},
                      {"walk": values("encode", "rollout", "plan"), "frames": values(frames(2, ac)),
                       "states": values(encode_value(torch.zeros(7))), "goal": values(frames(1, ac)),
                       "actions": values(encode_value(torch.zeros(2, 7))), "horizon": values(2), "samples": values(8),
                       "topk": values(1), "iterations": values(2), "seed": values(0, 2**63 - 1),
                       "preprocess": values(True)}),
    }


@pytest.mark.parametrize("name", ["vjepa2", "vjepa2-ac"])
def test_native_prepare_never_fails_as_a_server_error(models, name):
    base, fields = cases(models)[name]
    loaded = models[name]
    assert isinstance(loaded.prepare_inputs(decode_inputs(base)), dict)  # the base is valid: mutations go deep

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large])
    @given(inputs=mutated(base, fields))
    def run(inputs):
        try:
            check_fields(inputs, where="inputs.")
            loaded.prepare_inputs(decode_inputs(inputs))
        except CLIENT_ERRORS:
            pass

    run()
