"""openpi's websocket policy protocol at `/` on the server's own port, so an unchanged `openpi-client`
`WebsocketClientPolicy(host, port)` drives any served model that declares it (pi0 / pi0.5). The package
adds it to the server through the `mstar_register_routes` hook (`plugin.py`).

The protocol: the server sends the policy's metadata on connect (msgpack), then answers each observation
(a msgpack map with numpy arrays) with `{"actions": ndarray, "server_timing": {...}}`. Arrays travel in
openpi-client's msgpack encoding: a map `{b"__ndarray__": True, b"data": raw bytes, b"dtype": "<f4",
b"shape": [...]}` (numpy scalars as `{b"__npgeneric__": True, b"data": value, b"dtype": ...}`). A bad
observation gets a text frame (openpi-client raises it as a `RuntimeError`) naming the key, and the
connection stays open for the next one.

A model opts in with `LoadedModel.extras["policy_server"]`: `{"mappings": {name: mapping}, "metadata": {...}}`.
A mapping turns a robot's observation keys into the model's request fields (`ObservationMapping`).
`MSTAR_POLICY_MAPPING` picks one by name, or names a JSON file holding one; unset, each observation
uses the first declared mapping whose keys it carries. `MSTAR_POLICY_MODEL` picks the model when
several served models declare the protocol (default: the first one loaded). With an API key set, the
handshake must carry `Authorization: Api-Key <key>` (what openpi-client sends) or `Bearer <key>`.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from mstar_core.api.http.errors import ApiError
from mstar_core.api.requests.submit import submit
from mstar_core.errors import ConfigError, RequestError
from mstar_core.strict import reject_unknown

log = logging.getLogger("mstar.pi05.policy")
router = APIRouter()
WS_PATH = "/"
#: numpy dtype kinds an observation array may have: bool, ints, unsigned ints, floats (never objects or voids)
_KINDS = frozenset("biuf")


# -- msgpack with numpy arrays (openpi-client's wire form) ------------------------------------------------


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu().numpy()
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in _KINDS:
            raise TypeError(f"cannot send an array of dtype {obj.dtype}")
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str,
                b"shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot send a {type(obj).__name__}")


def _dtype(value: Any) -> np.dtype:
    try:
        dtype = np.dtype(value)
    except (TypeError, ValueError):
        raise ValueError(f"unknown array dtype {value!r:.40}") from None
    if dtype.kind not in _KINDS:
        raise ValueError(f"array dtype {dtype} is not accepted (bool, integers and floats are)")
    return dtype


def _unpack_hook(obj: dict) -> Any:
    if b"__ndarray__" in obj:
        dtype, data, shape = _dtype(obj.get(b"dtype")), obj.get(b"data"), obj.get(b"shape")
        if not isinstance(data, bytes) or not isinstance(shape, list | tuple) or len(shape) > 8 or not all(
                isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError("malformed array: needs bytes 'data' and a 'shape' of at most 8 non-negative ints")
        if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != len(data):
            raise ValueError(f"malformed array: shape {list(shape)} of {dtype} needs "
                             f"{int(np.prod(shape)) * dtype.itemsize} bytes, got {len(data)}")
        return np.frombuffer(data, dtype=dtype).reshape(shape).copy()  # a copy: writable, owns its memory
    if b"__npgeneric__" in obj:
        data = obj.get(b"data")
        if isinstance(data, str | bytes):  # a numpy string scalar (np.str_ prompts): its value is all we need
            return data
        return _dtype(obj.get(b"dtype")).type(data)
    return obj


def packb(obj: Any) -> bytes:
    """msgpack bytes, numpy arrays and torch tensors in openpi-client's array encoding."""
    import msgpack

    return msgpack.packb(obj, default=_pack_default)


def unpackb(data: bytes) -> Any:
    """The inverse of `packb`; a malformed array raises `ValueError` (never builds an object array)."""
    import msgpack

    return msgpack.unpackb(data, object_hook=_unpack_hook)


# -- observation keys -> model inputs --------------------------------------------------------------------


class ObservationError(RequestError):
    """An observation the mapping cannot read; `param` is the observation key."""


def _keys(value: Any, where: str) -> tuple[str, ...]:
    keys = (value,) if isinstance(value, str) else value
    if not isinstance(keys, list | tuple) or not keys or not all(isinstance(k, str) and k for k in keys):
        raise ConfigError(f"{where} must be an observation key or a non-empty list of keys, got {value!r}")
    return tuple(keys)


@attrs.frozen
class ObservationMapping:
    """How one robot's observation becomes a model's request inputs.

    `fields`: model field -> observation key, or a list of keys: an `array` field (camera images) gets the
    list of their values, a `tensor` field (the state) their values flattened and joined in order.
    `fixed`: constant inputs (the robot's action_dim). `optional`: model field -> key, passed when sent.
    """

    name: str
    fields: Mapping[str, tuple[str, ...]]
    fixed: Mapping[str, Any] = attrs.field(factory=dict)
    optional: Mapping[str, str] = attrs.field(factory=dict)

    @classmethod
    def from_dict(cls, name: str, data: Mapping[str, Any], where: str = "policy mapping") -> ObservationMapping:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where} '{name}' must be a mapping, got {type(data).__name__}")
        reject_unknown(data, ("name", "fields", "fixed", "optional"), f"{where} '{name}'")
        fields = data.get("fields")
        if not isinstance(fields, Mapping) or not fields:
            raise ConfigError(f"{where} '{name}': 'fields' must map model fields to observation keys")
        optional = data.get("optional") or {}
        fixed = data.get("fixed") or {}
        if not isinstance(optional, Mapping) or not isinstance(fixed, Mapping):
            raise ConfigError(f"{where} '{name}': 'fixed' and 'optional' must be mappings")
        return cls(str(data.get("name", name)), {f: _keys(k, f"{where} '{name}': fields.{f}") for f, k in fields.items()},
                   dict(fixed), {f: _keys(k, f"{where} '{name}': optional.{f}")[0] for f, k in optional.items()})

    @property
    def required_keys(self) -> list[str]:
        return [k for keys in self.fields.values() for k in keys]

    def missing(self, observation: Mapping[str, Any]) -> list[str]:
        return [k for k in self.required_keys if k not in observation]

    def inputs(self, observation: Mapping[str, Any], kinds: Mapping[str, str]) -> dict[str, Any]:
        """The request inputs; `kinds` gives each model field's schema kind (`array`, `tensor`, ...)."""
        missing = self.missing(observation)
        if missing:
            raise ObservationError(f"observation key '{missing[0]}' is missing (mapping '{self.name}' reads "
                                   f"{self.required_keys})", param=missing[0])
        out: dict[str, Any] = dict(self.fixed)
        for field, keys in self.fields.items():
            kind = kinds.get(field, "any")
            values = [_value(observation[k], k) for k in keys]
            if kind == "tensor":
                out[field] = values[0] if len(keys) == 1 else torch.cat([_flat(v, k) for v, k in zip(values, keys, strict=True)])
            elif kind == "array":
                out[field] = values
            elif len(keys) == 1:
                out[field] = values[0]
            else:
                raise ObservationError(f"mapping '{self.name}': field '{field}' takes one key, got {list(keys)}",
                                       param=keys[0])
        for field, key in self.optional.items():
            if observation.get(key) is not None:
                out[field] = _value(observation[key], key)
        return out

    def keys_for(self, param: str | None) -> list[str]:
        """The observation keys behind a model field named in an error (`images[1]` -> the second image key)."""
        match = re.fullmatch(r"([^\[]+)(?:\[(\d+)\])?", param or "")
        if match is None:
            return []
        field, index = match.group(1), match.group(2)
        keys = self.fields.get(field) or ((self.optional[field],) if field in self.optional else ())
        if index is not None and int(index) < len(keys):
            return [keys[int(index)]]
        return list(keys)


def _value(value: Any, key: str) -> Any:
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.astype(value.dtype.newbyteorder("="), copy=False))  # torch takes native order
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ObservationError(f"observation key '{key}' is bytes that are not UTF-8", param=key) from None
    return value


def _flat(value: Any, key: str) -> torch.Tensor:
    if isinstance(value, bool) or not isinstance(value, torch.Tensor | int | float | list | tuple):
        raise ObservationError(f"observation key '{key}' must be a numeric array, got {type(value).__name__}",
                               param=key)
    try:
        return torch.as_tensor(value, dtype=torch.float64).reshape(-1)
    except (TypeError, ValueError, RuntimeError):
        raise ObservationError(f"observation key '{key}' must be a numeric array", param=key) from None


# -- which model and mapping a connection uses -----------------------------------------------------------


def policy_models(engine: Any) -> list[str]:
    """Served models that declare the protocol, in load order."""
    return [name for name, loaded in engine.models.items() if (loaded.extras or {}).get("policy_server")]


def _choose_model(engine: Any) -> str:
    names = policy_models(engine)
    wanted = os.environ.get("MSTAR_POLICY_MODEL")
    if wanted:
        if wanted not in names:
            raise ConfigError(f"MSTAR_POLICY_MODEL is '{wanted}', but the policy models served are {names or 'none'}")
        return wanted
    if not names:
        raise ConfigError(f"no served model speaks the websocket policy protocol (served: {sorted(engine.models)})")
    return names[0]


def declared_mappings(loaded: Any) -> list[ObservationMapping]:
    raw = loaded.extras["policy_server"].get("mappings") or {}
    return [ObservationMapping.from_dict(name, data) for name, data in raw.items()]


def configured_mapping(declared: list[ObservationMapping]) -> ObservationMapping | None:
    """`MSTAR_POLICY_MAPPING`: a declared mapping's name, or a JSON file with one; None (unset): chosen per observation."""
    wanted = os.environ.get("MSTAR_POLICY_MAPPING", "").strip()
    if not wanted or wanted == "auto":
        return None
    for mapping in declared:
        if mapping.name == wanted:
            return mapping
    path = Path(wanted)
    if not path.is_file():
        raise ConfigError(f"MSTAR_POLICY_MAPPING is '{wanted}': neither a declared mapping "
                          f"({[m.name for m in declared]}) nor a JSON file")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"MSTAR_POLICY_MAPPING file {path}: {exc}") from None
    return ObservationMapping.from_dict(path.stem, data, where=f"MSTAR_POLICY_MAPPING file {path}")


def pick_mapping(observation: Mapping[str, Any], declared: list[ObservationMapping]) -> ObservationMapping:
    """The first declared mapping whose keys the observation carries; else the closest (its error names a key)."""
    for mapping in declared:
        if not mapping.missing(observation):
            return mapping
    return min(declared, key=lambda m: len(m.missing(observation)))


# -- the socket ------------------------------------------------------------------------------------------


def _authorized(ws: WebSocket, key: str) -> bool:
    scheme, _, token = ws.headers.get("authorization", "").partition(" ")
    return scheme.lower() in ("api-key", "bearer") and hmac.compare_digest(token.strip().encode(), key.encode())


def _error_text(exc: BaseException, mapping: ObservationMapping | None) -> str:
    message = getattr(exc, "message", None) or str(exc)
    if isinstance(exc, ObservationError) or mapping is None:
        return message
    keys = mapping.keys_for(getattr(exc, "param", None))
    if not keys:
        return message
    return f"observation key{'s' if len(keys) > 1 else ''} {', '.join(repr(k) for k in keys)}: {message}"


@router.websocket(WS_PATH)
async def policy_socket(ws: WebSocket) -> None:
    state = ws.app.state.mstar
    if state.config.api_key and not _authorized(ws, state.config.api_key):
        await ws.close(code=1008, reason="missing or wrong API key; send 'Authorization: Api-Key <key>'")
        return
    if not state.ready:
        await ws.close(code=1013, reason="models are still loading; retry shortly")
        return
    try:
        model = _choose_model(state.engine)
        loaded = state.engine.models[model]
        declared = declared_mappings(loaded)
        fixed = configured_mapping(declared)
    except ConfigError as exc:
        await ws.close(code=1011, reason=str(exc)[:120])
        return
    schema = loaded.request_schema
    kinds = {f.name: f.kind for f in schema.fields} if schema is not None else {}
    await ws.accept()
    metadata = {**(loaded.extras["policy_server"].get("metadata") or {}), "model": model,
                "mapping": fixed.name if fixed else "auto", "mappings": {m.name: m.required_keys for m in declared}}
    await ws.send_bytes(packb(metadata))
    session = _Session(state, model, declared, fixed, kinds)
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        # one observation at a time, as openpi's server: the client waits for each answer before sending more
        reply = await session.answer(message.get("bytes"))
        try:
            await (ws.send_text(reply) if isinstance(reply, str) else ws.send_bytes(reply))
        except (WebSocketDisconnect, RuntimeError, OSError):
            return


@attrs.define
class _Session:
    """One connection's model and mapping; `answer(frame)` -> packed actions, or an error text."""

    state: Any
    model: str
    declared: list[ObservationMapping]
    fixed: ObservationMapping | None
    kinds: Mapping[str, str]
    previous_total_ms: float | None = None

    async def answer(self, data: bytes | None) -> bytes | str:
        if data is None:
            return "send each observation as a msgpack binary frame"
        started = time.monotonic()
        mapping = self.fixed
        try:
            try:
                observation = unpackb(data)
            except Exception as exc:  # msgpack's own errors and malformed arrays
                raise ObservationError(f"the observation is not valid msgpack: {str(exc) or type(exc).__name__}") from None
            if not isinstance(observation, Mapping):
                raise ObservationError(f"an observation must be a msgpack map, got {type(observation).__name__}")
            mapping = self.fixed or pick_mapping(observation, self.declared)
            handle = await submit(self.state, self.model, mapping.inputs(observation, self.kinds))
            actions = (await handle.result())["actions"]
        except (RequestError, ApiError) as exc:
            return _error_text(exc, mapping)
        except Exception as exc:  # a failed walk fails this observation, not the connection
            log.warning("policy observation failed: %s: %s", type(exc).__name__, exc)
            return f"{type(exc).__name__}: {exc}"
        timing = {"infer_ms": (time.monotonic() - started) * 1000}
        if self.previous_total_ms is not None:
            timing["prev_total_ms"] = self.previous_total_ms
        packed = packb({"actions": actions.float().cpu().numpy(), "server_timing": timing})
        self.previous_total_ms = (time.monotonic() - started) * 1000
        return packed
