"""The model author's guide says what a first plugin author could not find (issue 13), and stays true to the code:
its package excerpts are the example package's files, its module contracts are the engines' protocols, and its
tensor-JSON recipe is what the native endpoint decodes."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import numpy as np
import torch
from mstar_diffusion.contract import DenoiserModule
from mstar_kvcache.contract import CONFIG_FIELDS, KVCacheModule

from mstar_core.api.media.tensors import decode_tensor
from mstar_core.runtime.contract import BatchedModule, KeywordModule

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "MODEL_AUTHORS.md").read_text()
EXAMPLE = ROOT / "examples" / "mstar-example-captioner"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", GUIDE, flags=re.S)


def _section(heading: str) -> str:
    start = GUIDE.index(heading)
    end = GUIDE.find("\n## ", start + len(heading))
    return GUIDE[start:end]


def _protocol_methods(proto: type) -> set[str]:
    return {n for n, v in vars(proto).items() if callable(v) and not n.startswith("_")}


def test_the_readme_links_the_guide():
    assert "](docs/MODEL_AUTHORS.md)" in (ROOT / "README.md").read_text()


def test_the_package_excerpts_are_the_example_packages_own_files():
    quoted = tomllib.loads(next(b for b in _blocks("toml") if "[project.entry-points.mstar]" in b))
    real = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    assert quoted["project"]["entry-points"] == real["project"]["entry-points"] == {
        "mstar": {"example_captioner": "mstar_example_captioner.plugin"}}
    assert quoted["project"]["dependencies"] == real["project"]["dependencies"]
    assert quoted["tool"] == real["tool"]
    plugin = next(b for b in _blocks("python") if b.startswith("# src/mstar_example_captioner/plugin.py"))
    source = (EXAMPLE / "src" / "mstar_example_captioner" / "plugin.py").read_text()
    without_docstring = ast.parse(source)
    without_docstring.body = without_docstring.body[1:]
    assert ast.dump(ast.parse(plugin)) == ast.dump(without_docstring)


def test_each_engines_module_contract_is_written_down():
    kv = _section("### `kvcache`")
    for method in _protocol_methods(KVCacheModule):  # forward, embed, compute_logits
        assert f"def {method}(" in kv, method
    assert "input_embeds=None" in kv and "kv_cache_spec()" in kv
    for field in CONFIG_FIELDS:
        assert field in kv, field
    assert re.search(r"`sampling`.*Without it there is no `finish_reason`", kv)  # else the loop never ends
    for kind in ("### `stateless`", "### `function`"):  # both call a KeywordModule, or batch with forward_batch
        section = GUIDE[GUIDE.index(kind):GUIDE.index("\n### ", GUIDE.index(kind) + 4)]
        assert KeywordModule.__name__ in section and "keyword arguments" in section, kind
        for method in _protocol_methods(BatchedModule):
            assert method in section, (kind, method)
    diffusion = GUIDE[GUIDE.index("### `diffusion`"):GUIDE.index("### `stateless`")]
    assert f"{DenoiserModule.__name__}` (`forward(x, t, /, **cond)`" in diffusion

def test_requests_errors_plans_and_placement_have_their_sections():
    for heading, words in {
        "## 3. The graph": ("plan=", "optional_inputs", "Copy(", "Rename("),
        "## 5. Requests": ("prepare", "RequestError", "RequestField", "example"),
        "## 8. Placement": ("yaml", "mstar serve example-captioner"),
        "## 1. The package": ("[project.entry-points.mstar]", "from mstar_core import hookimpl", "mstar plugins"),
    }.items():
        section = _section(heading)
        for word in words:
            assert word in section, (heading, word)


def test_the_guides_tensor_json_recipe_decodes_to_the_same_array():
    recipe = next(b for b in _blocks("python") if "def tensor_json(" in b)
    fn = next(n for n in ast.parse(recipe).body if isinstance(n, ast.FunctionDef) and n.name == "tensor_json")
    scope = {"np": np, "base64": __import__("base64")}
    exec(compile(ast.Module([fn], []), "guide", "exec"), scope)
    for array in (np.arange(24, dtype=np.uint8).reshape(2, 3, 4), np.linspace(-1, 1, 6, dtype=np.float32)[::2]):
        decoded = decode_tensor(scope["tensor_json"](array), "inputs.image")
        assert torch.equal(decoded, torch.from_numpy(np.ascontiguousarray(array)))
