from mstar_core import hookimpl


@hookimpl
def mstar_register_models(register):
    from mstar_qwen_omni.model import SPEC  # imported lazily: `mstar plugins` stays fast

    register(SPEC)


@hookimpl
def mstar_register_api_adapters(register):
    from mstar_qwen_omni.adapter import QwenOmniAdapter  # imported lazily: `mstar plugins` stays fast

    register(QwenOmniAdapter())
