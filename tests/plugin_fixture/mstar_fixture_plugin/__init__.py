"""A third-party-style plugin used by the tests: models, engines and a transport registered by entry point."""

from mstar_core.plugins import hookimpl


@hookimpl
def mstar_register_engines(register):
    from mstar_fixture_plugin.chain import ChainEngine
    from mstar_fixture_plugin.counter import CounterEngine
    from mstar_fixture_plugin.engine import EchoEngine

    register("fixture_echo", EchoEngine)
    register("fixture_counter", CounterEngine)
    register("fixture_chain", ChainEngine)


@hookimpl
def mstar_register_models(register):
    from mstar_fixture_plugin.blob import SPEC as BLOB_SPEC
    from mstar_fixture_plugin.branches import SPEC as BRANCHES_SPEC
    from mstar_fixture_plugin.chain import SPEC as CHAIN_SPEC
    from mstar_fixture_plugin.counter import SPEC as STREAM_SPEC
    from mstar_fixture_plugin.model import SPEC
    from mstar_fixture_plugin.rename import SPEC as RENAME_SPEC

    register(SPEC)
    register(RENAME_SPEC)
    register(STREAM_SPEC)
    register(BLOB_SPEC)
    register(CHAIN_SPEC)
    register(BRANCHES_SPEC)
    from mstar_fixture_plugin.chat_models import MEDIA, NARRATOR, TALKER

    register(TALKER)
    register(NARRATOR)
    register(MEDIA)


@hookimpl
def mstar_register_api_adapters(register):
    from mstar_fixture_plugin.chat_models import ADAPTERS

    for adapter in ADAPTERS:
        register(adapter())


@hookimpl
def mstar_register_transports(register):
    from mstar_fixture_plugin.pipe import PipeTransport
    from mstar_fixture_plugin.spool import SpoolTransport

    register("fixture_spool", SpoolTransport)
    register("fixture_pipe", PipeTransport)  # point to point only: no worker links
