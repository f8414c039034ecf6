import pytest
import torch

from mstar_core.errors import ConfigError
from mstar_core.model import LoadOptions


def test_torch_dtype_names_the_model_and_the_choices():
    assert LoadOptions(checkpoint="x").torch_dtype("m") is torch.float32
    assert LoadOptions(checkpoint="x").torch_dtype("m", "bfloat16") is torch.bfloat16
    assert LoadOptions(checkpoint="x", dtype="float16").torch_dtype("m", "bfloat16") is torch.float16
    with pytest.raises(ConfigError, match=r"m: unknown dtype 'int8'; use one of \['bfloat16', 'float16', 'float32'\]"):
        LoadOptions(checkpoint="x", dtype="int8").torch_dtype("m")
