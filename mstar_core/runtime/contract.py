"""Module contracts: what an engine calls on a node's module, checked when the engine is built.

Each engine states its contract as a `typing.Protocol`. A protocol method's signature says how
the engine calls it: positional-only parameters are passed by position, keyword-only ones by
name, and a parameter with a default is passed only on some calls. `check_method` holds a built
module's own method (looked up on the object, so meta-device, hooked and wrapped modules pass)
against that call, so a module that cannot take it fails when the model loads, naming the node,
the engine and the method, instead of failing every request with an `AttributeError`.

The generic contract of engines that call a module once per invocation (`function`,
`stateless`) is `KeywordModule` or `BatchedModule`; `check_keyword_module` checks either.
"""

from __future__ import annotations

import inspect
import keyword
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import torch

from mstar_core.errors import ModuleContractError

_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)


class KeywordModule(Protocol):
    """Called once per invocation (or per stacked batch) with the node's inputs as keyword arguments.

    Every declared input is passed; an optional input only when the request has it, so its
    parameter needs a default. Returns a dict of outputs, a tuple in output order, or one value.
    """

    def __call__(self, **inputs: Any) -> Any: ...


class BatchedModule(Protocol):
    """Batches itself: one call with every invocation's inputs, one output dict per invocation back."""

    def forward_batch(self, calls: list[dict[str, Any]], /) -> list[Mapping[str, Any]]: ...


def protocol_call(protocol: type, method: str, omit: Iterable[str] = ()) -> inspect.Signature:
    """The call an engine makes, from `protocol.method`'s signature without `self` and the `omit`ted parameters."""
    sig = inspect.signature(getattr(protocol, method))
    skip = set(omit)
    params = [p for i, p in enumerate(sig.parameters.values()) if i and p.name not in skip]
    return sig.replace(parameters=params)


def _python_name(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name)


def keyword_call(required: Iterable[str], optional: Iterable[str] = ()) -> inspect.Signature:
    """The call of a `KeywordModule`: each input by name, optional ones sometimes left out.

    (Inputs that are not Python names can only reach a `**inputs` parameter; they are left out here.)
    """
    params = [_P(name, _P.KEYWORD_ONLY) for name in required if _python_name(name)]
    params += [_P(name, _P.KEYWORD_ONLY, default=None) for name in optional if _python_name(name)]
    return inspect.Signature(params)


def describe_call(name: str, call: inspect.Signature) -> str:
    """`name(a, b, c=None)`: the call as a module author would write the method."""
    parts = [
        f"**{p.name}" if p.kind is _P.VAR_KEYWORD else p.name if p.default is _P.empty else f"{p.name}={p.default!r}"
        for p in call.parameters.values()
    ]
    return f"{name}({', '.join(parts)})"


def module_callable(module: Any) -> Callable[..., Any] | None:
    """What runs when the engine calls `module(...)`: an nn.Module's `forward`, else the callable itself."""
    inner = getattr(module, "_orig_mod", None)  # torch.compile's wrapper: its forward takes *args, **kwargs
    if inner is not None:
        module = inner
    if isinstance(module, torch.nn.Module):  # __call__ runs forward (plus hooks)
        return getattr(module, "forward", None)
    return module if callable(module) else None


def call_problems(fn: Callable[..., Any], call: inspect.Signature) -> list[str]:
    """Why `fn` cannot take `call` (empty if it can, or if its signature cannot be read)."""
    try:
        actual = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and C callables: nothing to check against
        return []
    var_pos = any(p.kind is _P.VAR_POSITIONAL for p in actual)
    var_kw = any(p.kind is _P.VAR_KEYWORD for p in actual)
    positional = [p for p in actual if p.kind in _POSITIONAL]
    passed_pos = [p for p in call.parameters.values() if p.kind is _P.POSITIONAL_ONLY]
    passed_kw = {p.name: p for p in call.parameters.values() if p.kind in (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)}
    problems: list[str] = []
    if any(p.kind is _P.VAR_KEYWORD for p in call.parameters.values()) and not var_kw:
        problems.append("takes no **keyword arguments, and the engine passes some by names no parameter can have")
    if len(passed_pos) > len(positional) and not var_pos:
        names = ", ".join(p.name for p in passed_pos)
        problems.append(f"takes {len(positional)} positional argument(s), the engine passes {len(passed_pos)} ({names})")
    taken = {}  # actual parameter name -> what the engine binds to it
    for want, got in zip(passed_pos, positional, strict=False):
        taken[got.name] = want
        if want.default is not _P.empty and got.default is _P.empty:
            problems.append(f"parameter '{got.name}' (the engine's '{want.name}') needs a default: "
                            "the engine leaves it out on some calls")
    by_name = {p.name: p for p in actual}
    for name, want in passed_kw.items():
        got = by_name.get(name)
        if got is None or got.kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD):
            if not var_kw:
                problems.append(f"has no parameter '{name}', which the engine passes by name")
            continue
        if got.kind is _P.POSITIONAL_ONLY:
            problems.append(f"parameter '{name}' is positional-only, the engine passes it by name")
            continue
        if name in taken:
            problems.append(f"parameter '{name}' is already filled by the engine's positional '{taken[name].name}'")
            continue
        taken[name] = want
        if want.default is not _P.empty and got.default is _P.empty:
            problems.append(f"parameter '{name}' needs a default: the engine passes it only on some calls")
    for p in actual:
        if p.default is _P.empty and p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD) and p.name not in taken:
            problems.append(f"requires parameter '{p.name}', which the engine never passes")
    return problems


def _where(node: str, engine: str) -> str:
    return f"node '{node}' (engine '{engine}')"


def check_method(
    module: Any, method: str, call: inspect.Signature, *, node: str, engine: str, why: str = ""
) -> None:
    """Raise `ModuleContractError` unless the module's `method` exists and can take `call`.

    `method` "forward" or "__call__" means what `module(...)` runs (an nn.Module's forward, else the
    callable). `why` says when the engine needs the method, for the message.
    """
    fn = module_callable(module) if method in ("forward", "__call__") else getattr(module, method, None)
    expected = describe_call("module" if method == "__call__" else method, call)
    if fn is None or not callable(fn):
        state = "has no" if fn is None else "has a non-callable"
        raise ModuleContractError(
            f"{_where(node, engine)}: module {type(module).__name__} {state} method '{method}'"
            f"{f' ({why})' if why else ''}; the engine calls {expected}. Add it to the module, or run the node "
            "on an engine whose contract it meets",
            node=node, engine=engine, method=method,
        )
    problems = call_problems(fn, call)
    if problems:
        shown = getattr(fn, "__qualname__", None) or type(fn).__name__
        try:
            actual = f"{shown}{inspect.signature(fn)}"
        except (TypeError, ValueError):  # (call_problems found none for such callables)
            actual = shown
        raise ModuleContractError(
            f"{_where(node, engine)}: {actual} cannot take the engine's call {expected}: {'; '.join(problems)}",
            node=node, engine=engine, method=method,
        )


def check_keyword_module(module: Any, node: Any, engine: str) -> None:
    """Check a `KeywordModule` or `BatchedModule` for `node` (the `function` and `stateless` engines)."""
    if getattr(module, "forward_batch", None) is not None:
        check_method(module, "forward_batch", protocol_call(BatchedModule, "forward_batch"), node=node.name, engine=engine)
        return
    if module is None or not callable(module):
        raise ModuleContractError(
            f"{_where(node.name, engine)}: the module must be callable with the node's inputs as keyword arguments "
            f"({describe_call('module', keyword_call(node.inputs, node.optional_inputs))}) or have "
            f"forward_batch(calls); got {type(module).__name__}",
            node=node.name, engine=engine,
        )
    call = keyword_call(node.inputs, node.optional_inputs)
    odd = [n for n in (*node.inputs, *node.optional_inputs) if not _python_name(n)]
    if odd:  # only `**inputs` can take them: ask for that
        call = call.replace(parameters=[*call.parameters.values(), _P("inputs", _P.VAR_KEYWORD)])
    check_method(module, "__call__", call, node=node.name, engine=engine)
