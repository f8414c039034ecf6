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


def test_the_device_default_is_bfloat16_on_cuda_and_float32_elsewhere():
    assert LoadOptions(checkpoint="x").torch_dtype("m", None) is torch.float32
    assert LoadOptions(checkpoint="x", device="cuda:1").torch_dtype("m", None) is torch.bfloat16
    assert LoadOptions(checkpoint="x", device="cuda", dtype="float32").torch_dtype("m", None) is torch.float32


def test_preset_or_checkpoint_is_decided_once_for_every_loader():
    assert LoadOptions().preset_or_checkpoint("m", ("tiny", "big")) == "tiny"
    assert LoadOptions(preset="big").preset_or_checkpoint("m", ("tiny", "big")) == "big"
    assert LoadOptions(checkpoint="/ckpt").preset_or_checkpoint("m", ("tiny",)) is None
    with pytest.raises(ConfigError, match="m: pass a checkpoint or a preset, not both"):
        LoadOptions(checkpoint="/ckpt", preset="tiny").preset_or_checkpoint("m", ("tiny",))
    with pytest.raises(ConfigError, match=r"m: unknown preset 'huge'; known: \['tiny'\]"):
        LoadOptions(preset="huge").preset_or_checkpoint("m", ("tiny",))


@pytest.mark.parametrize("family", ["bagel", "llama", "orpheus", "pi05", "qwen3-omni", "qwen3-tts", "vjepa2", "wan",
                                    "whisper", "example-captioner"])
def test_every_loader_refuses_an_unknown_preset_before_loading_anything(family):
    from mstar_core.plugins import default_registry

    spec = default_registry().models.get(family)
    with pytest.raises(ConfigError, match=f"{family}: unknown preset 'huge'"):
        spec.load(LoadOptions(preset="huge"))
