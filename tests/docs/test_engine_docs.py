"""The engine docs match the engines: option tables, every `options={...}` in a code example, the architecture
guide's graph."""

import ast
import re
from pathlib import Path

import pytest
from mstar_diffusion.params import KNOWN_OPTIONS as DIFFUSION_OPTIONS
from mstar_kvcache.inputs import BUILTIN_INPUTS
from mstar_kvcache.inputs import OPTIONS as KVCACHE_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "MODEL_AUTHORS.md").read_text()
README = (ROOT / "README.md").read_text()
ARCHITECTURE = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
STATELESS_OPTIONS = {"pad_dim", "pad_value", "batch"}
BY_ENGINE = {"kvcache": set(KVCACHE_OPTIONS), "diffusion": set(DIFFUSION_OPTIONS), "stateless": STATELESS_OPTIONS}
INTERNAL = {"transfer"}  # set by the runtime when a cache moves between workers (with input `state`), never by a model


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n### ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def _table(section: str, header: str) -> set[str]:
    """The backticked names in the first column of the table under `header`."""
    table = section[section.index(header):].split("\n\n")[0]
    return {n for cell in re.findall(r"^\| ([^|]+)\|", table, flags=re.M) for n in re.findall(r"`(\w+)`", cell)}


def test_the_kvcache_tables_list_exactly_the_engines_options_and_inputs():
    kv = _section(GUIDE, "### `kvcache`")
    assert _table(kv, "| option | effect |") == set(KVCACHE_OPTIONS) - INTERNAL
    assert _table(kv, "| input | value |") == set(BUILTIN_INPUTS) - {"state"}  # `state`: a cache moving workers


def test_the_diffusion_section_names_every_option():
    section = _section(GUIDE, "### `diffusion`")
    named = set(re.findall(r"`(\w+)`", section))
    assert set(DIFFUSION_OPTIONS) - {"inline"} <= named  # `inline` is the runtime's, for every engine


@pytest.mark.parametrize("block", _python_blocks(GUIDE) + _python_blocks(README) + _python_blocks(ARCHITECTURE))
def test_every_option_in_a_code_example_is_one_the_engine_knows(block):
    for call in (n for n in ast.walk(ast.parse(block)) if isinstance(n, ast.Call)):
        name = getattr(call.func, "id", None)
        kwargs = {k.arg: k.value for k in call.keywords}
        if name not in ("NodeCall", "GraphNode") or not isinstance(kwargs.get("options"), ast.Dict):
            continue
        engine = kwargs.get("engine")
        known = (BY_ENGINE[engine.value] if isinstance(engine, ast.Constant)
                 else set(KVCACHE_OPTIONS) | set(DIFFUSION_OPTIONS))
        keys = [k.value for k in kwargs["options"].keys]
        assert set(keys) <= known, f"{ast.unparse(call)[:80]}: unknown options {set(keys) - known}"


def test_the_architecture_guides_graph_example_builds():
    block = next(b for b in _python_blocks(ARCHITECTURE) if "Graph.build(" in b)
    scope = {"build_lm": None, "build_codec": None}
    exec(block, scope)  # module factories are only called when engines are built
    assert set(scope["graph"].walks) == {"speech"}
