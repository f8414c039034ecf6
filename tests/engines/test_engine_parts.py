"""The kvcache engine's shape: parts that declare their state, composed by an engine with no mixin base, and no
file of the package reading another package's (or torch's) underscore attributes."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import mstar_kvcache
import pytest
from mstar_kvcache import KVCacheEngine

from mstar_core.runtime.engine import Engine

PACKAGE = Path(mstar_kvcache.__file__).parent
FILES = sorted(PACKAGE.glob("*.py"))

#: Underscore names the package may still touch, and why: torch has no public knob for dynamo's recompile limit
#: nor a public probe for inductor's C++ compiler (compile support only); `os._exit` is the documented way out
#: of a process whose rank group broke.
ALLOWED = {("compiled.py", "torch._dynamo"), ("compiled.py", "torch._inductor.cpp_builder"), ("ranks.py", "os._exit")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _foreign_private_uses(source: str) -> list[str]:
    """`x._name` where `x` is not `self` / `cls`, `getattr(x, "_name")`, and imports of `pkg._module`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(ast.unparse(node))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and not (isinstance(node.args[0], ast.Name)
                                                         and node.args[0].id in ("self", "cls"))):
            found.append(ast.unparse(node))
        elif isinstance(node, ast.ImportFrom) and node.module and any(map(_private, node.module.split("."))):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(a.name for a in node.names if any(map(_private, a.name.split("."))))
    return found


def test_the_engine_has_no_mixin_base():
    assert KVCacheEngine.__bases__ == (Engine,)


def test_no_class_of_the_package_is_a_mixin():
    names = [n.name for f in FILES for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.ClassDef)]
    assert names and not [n for n in names if n.endswith("Mixin")]


def test_no_file_touches_an_underscore_attribute_of_torch_or_of_another_package():
    used = {(f.name, use) for f in FILES for use in _foreign_private_uses(f.read_text())}
    assert used <= ALLOWED, sorted(used - ALLOWED)
    assert not {u for f, u in used if f in ("replay.py", "engine.py")}


def test_the_check_finds_what_replay_used_to_read():
    old = "p = owner._parameters\nv = param._version\nf = layer._fast\nh = getattr(module, '_forward_hooks', None)\n"
    assert _foreign_private_uses(old) == ["owner._parameters", "param._version", "layer._fast",
                                          "getattr(module, '_forward_hooks', None)"]
    assert _foreign_private_uses("self._order = 1\nx = self._order\n") == []


def _declared(cls: type) -> set[str]:
    """Names a class (and its bases) declares: `self.x = ...` in an `__init__`, and class-level names."""
    names: set[str] = set()
    for klass in cls.__mro__:
        names |= set(vars(klass)) | set(getattr(klass, "__annotations__", {}))
        init = vars(klass).get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        try:
            tree = ast.parse(inspect.getsource(init).strip())
        except (OSError, TypeError, SyntaxError):
            continue
        names |= {t.attr for n in ast.walk(tree) if isinstance(n, ast.Assign | ast.AnnAssign)
                  for target in (n.targets if isinstance(n, ast.Assign) else [n.target])
                  for t in ast.walk(target) if isinstance(t, ast.Attribute)
                  and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return names


#: The engine's parts and the engine itself: each reads and writes only state its own class declares
PARTS = ["answers.CallAnswers", "engine.KVCacheEngine", "intake.CallIntake", "labels.Labels",
         "readers.ReadOnlyCalls", "ranks.StepLeader", "ranks.StepFollower", "rows.CallRows",
         "step_inputs.StepForward", "transfer.CacheTransfer", "replay.StepReplay", "blocks.BlockManager",
         "scheduler.Scheduler", "pool.PagePool", "offload.HostTier"]


@pytest.mark.parametrize("path", PARTS)
def test_each_part_uses_only_the_state_it_declares(path):
    module_name, name = path.split(".")
    cls = getattr(importlib.import_module(f"mstar_kvcache.{module_name}"), name)
    declared = _declared(cls)
    tree = ast.parse(inspect.getsource(cls))
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "self"}
    assert not used - declared, f"{name} uses undeclared state {sorted(used - declared)}"
