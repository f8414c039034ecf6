from mstar_core import hookimpl


@hookimpl
def mstar_register_models(register):
    from mstar_qwen_tts.model import SPEC  # imported lazily: `mstar plugins` stays fast

    register(SPEC)


@hookimpl
def mstar_register_api_adapters(register):
    from mstar_qwen_tts.adapter import QwenTTSAdapter  # imported lazily: `mstar plugins` stays fast

    register(QwenTTSAdapter())
