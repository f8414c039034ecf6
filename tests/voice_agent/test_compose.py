"""Composition: a model built from loaded models' nodes. Names get the part's prefix (nodes `<role>/<node>`, env
`<role>:<name>`), loops' callables read the part's own names, the parts' engines and schedulers serve the composed
model (no second copy), and every mistake is a ConfigError naming the key."""

from __future__ import annotations

import asyncio
import types

import pytest

from mstar_core.compose import CompositionSpec, check_roles
from mstar_core.config.compose import ComposeSettings
from mstar_core.errors import ConfigError
from mstar_core.graph import Copy, DynamicLoop, Graph, GraphNode, NodeCall, Sequential, Walk, to_mermaid
from mstar_core.graph.compose import PartEnv, PartNames
from mstar_core.model import LoadedModel
from mstar_core.plugins import discover, hookimpl
from mstar_core.runtime import AsyncEngine


class Inc:
    def __call__(self, x):
        return x + 1


def counter(name: str) -> LoadedModel:
    """Counts `x` up to `limit` in a DynamicLoop whose `until` and `max_iters` read the env by the part's names."""
    loop = DynamicLoop(body=NodeCall("inc", outputs={"y": "x"}), until=lambda env: env["x"] >= env["limit"],
                       max_iters="limit")
    count = Walk(name="count", body=loop,
                 inputs=("x", "limit"), outputs=("x",), emit=("x",))
    graph = Graph.build(name, [GraphNode("inc", inputs=("x",), outputs=("y",), engine="function", module=Inc)], [count])
    return LoadedModel(name=name, graph=graph)


def build_duo(name, parts, options):
    first, second = (PartNames(r, parts[r].graph) for r in ("first", "second"))
    count = parts["first"].graph.walks["count"]
    walk = Walk(name="both", body=Sequential(first.step(count.body, "count"), Copy({"second:x": "first:x"}),
                                             second.step(count.body, "count")),
                inputs=("first:x", "first:limit", "second:limit"), outputs=("second:x",), emit=("first:x", "second:x"))
    graph = Graph.build(name, [*first.nodes(), *second.nodes()], [walk])
    return LoadedModel(name=name, graph=graph, prepare=lambda r: {"first:x": r["x"], "first:limit": r["limits"][0],
                                                                  "second:limit": r["limits"][1]})


DUO = CompositionSpec("duo", ("first", "second"), build_duo, options={"tempo": "how fast"})


def registry():
    return discover(extra_modules=[types.SimpleNamespace(
        mstar_register_compositions=hookimpl(lambda register: register(DUO)))])


def test_a_part_renamed_keeps_its_walk_valid_and_drawable():
    part = PartNames("asr", counter("c").graph)
    walk = part.walk_spec(counter("c").graph.walks["count"])
    assert walk.name == "asr.count" and walk.inputs == ("asr:x", "asr:limit") and walk.emit == ("asr:x",)
    graph = Graph.build("g", part.nodes(), [walk])
    assert list(graph.nodes) == ["asr/inc"]
    assert "asr/inc" in to_mermaid(graph, "asr.count")
    view = PartEnv({"asr:x": 3, "llm:x": 9}, "asr")
    assert view["x"] == 3 and "x" in view and "limit" not in view and dict(view) == {"x": 3}


def test_a_composed_model_runs_on_its_parts_engines_and_its_loops_read_their_own_names():
    async def go():
        async with AsyncEngine(registry()) as engine:
            await engine.add_model(counter("a"))
            await engine.add_model(counter("b"))
            await engine.compose("duo", "duo", {"first": "a", "second": "b"})
            a, b, duo = engine.node_engines("a"), engine.node_engines("b"), engine.node_engines("duo")
            assert duo["first/inc"] is a["inc"] and duo["second/inc"] is b["inc"]  # the same engine objects
            sched = engine.node_schedulers("duo")
            assert sched["first/inc"] is engine.node_schedulers("a")["inc"]
            assert "first/inc" not in engine.stats()["models"]["duo"]  # reported once, by the model that owns it
            env = await engine.generate("duo", {"x": 0, "limits": [3, 5]})
            assert env["first:x"] == 3 and env["second:x"] == 5  # each loop stopped at its own part's limit
            # the standalone models still serve as before, beside the composed one
            assert (await engine.generate("a", {"x": 1, "limit": 2}))["x"] == 2
    asyncio.run(go())


def test_composing_names_the_offending_role_or_model():
    async def go():
        async with AsyncEngine(registry()) as engine:
            await engine.add_model(counter("a"))
            with pytest.raises(ConfigError, match=r"models\.duo\.second: model 'zzz' is not loaded"):
                await engine.compose("duo", "duo", {"first": "a", "second": "zzz"})
            with pytest.raises(ConfigError, match=r"models\.duo\.third: composition 'duo' has no role 'third'"):
                await engine.compose("duo", "duo", {"first": "a", "second": "a", "third": "a"})
            with pytest.raises(ConfigError, match=r"models\.duo\.second is missing"):
                await engine.compose("duo", "duo", {"first": "a"})
            with pytest.raises(LookupError, match="unknown composition 'trio'; known: .*duo"):
                await engine.compose("duo", "trio", {"first": "a"})
            with pytest.raises(ConfigError, match=r"only its own nodes take settings"):
                await engine.compose("duo", "duo", {"first": "a", "second": "a"}, settings={"first/inc": {}})
    asyncio.run(go())


def test_check_roles_names_the_key():
    with pytest.raises(ConfigError, match=r"models\.agent\.speaker: .*roles: first, second"):
        check_roles(DUO, {"first": "a", "second": "b", "speaker": "c"}, "models.agent")
    with pytest.raises(ConfigError, match=r"models\.agent\.options\.speed: .* has no option 'speed'; its options: tempo"):
        check_roles(DUO, {"first": "a", "second": "b"}, "models.agent", {"speed": 2})


def test_deploy_file_compose_entries_are_strict(tmp_path):
    from mstar_core.api.server.deploy import load_deploy

    def deploy(text):
        path = tmp_path / "deploy.yaml"
        path.write_text(text)
        return load_deploy(path)

    base = "models:\n  whisper: {preset: tiny}\n  llama: {preset: tiny}\n  qwen3-tts: {preset: tiny}\n"
    _, models = deploy(base + "  agent: {compose: voice_agent, asr: whisper, llm: llama, tts: qwen3-tts}\n")
    assert models["agent"].compose == ComposeSettings("voice_agent", {"asr": "whisper", "llm": "llama",
                                                                      "tts": "qwen3-tts"})
    with pytest.raises(ConfigError, match=r"models\.agent\.tts: model 'orpheus' is not in this file's models"):
        deploy(base + "  agent: {compose: voice_agent, asr: whisper, llm: llama, tts: orpheus}\n")
    with pytest.raises(ConfigError, match=r"models\.agent\.compose must name a composition"):
        deploy(base + "  agent: {compose: 3, asr: whisper}\n")
    with pytest.raises(ConfigError, match=r"models\.agent\.llm must name another model"):
        deploy(base + "  agent: {compose: voice_agent, asr: whisper, llm: [llama]}\n")
    with pytest.raises(ConfigError, match=r"models\.two\.asr: model 'agent' is composed itself"):
        deploy(base + "  agent: {compose: voice_agent, asr: whisper}\n  two: {compose: voice_agent, asr: agent}\n")
    _, models = deploy(base + "  agent: {compose: voice_agent, asr: whisper, options: {max_words: 9}}\n")
    assert models["agent"].compose.options == {"max_words": 9}
    with pytest.raises(ConfigError, match=r"models\.agent\.options must be a mapping"):
        deploy(base + "  agent: {compose: voice_agent, asr: whisper, options: 3}\n")
    with pytest.raises(ConfigError, match=r"models\.agent\.engines must map"):
        deploy(base + "  agent: {compose: voice_agent, asr: whisper, engines: [1]}\n")


def test_serve_config_loads_the_parts_and_refuses_a_composition_without_them(tmp_path):
    import argparse

    from mstar_core.api.server.launch import add_arguments, build_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    deploy = tmp_path / "d.yaml"
    deploy.write_text("models:\n  whisper: {preset: tiny}\n  llama: {preset: tiny}\n  qwen3-tts: {preset: tiny}\n"
                      "  agent: {compose: voice_agent, asr: whisper, llm: llama, tts: qwen3-tts}\n")
    config, _, _ = build_config(parser.parse_args(["--config", str(deploy)]))
    assert [m.name for m in config.models] == ["whisper", "llama", "qwen3-tts", "agent"]
    assert config.models[-1].compose.parts["tts"] == "qwen3-tts"
    with pytest.raises(ConfigError, match=r"models\.agent\.asr: model 'whisper' is not served"):
        build_config(parser.parse_args(["agent", "--config", str(deploy)]))
