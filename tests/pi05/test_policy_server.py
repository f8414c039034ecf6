"""`mstar serve pi05` (tiny) over HTTP and over openpi's websocket policy protocol at `/`.

The websocket client here speaks the protocol from openpi-client's source, with its own msgpack array
encoding (not the server's), so both ends are checked against the wire form rather than each other.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import msgpack
import numpy as np
import pytest

from tests.server.helpers import API_KEY, Server

websockets_sync = pytest.importorskip("websockets.sync.client")


# -- openpi-client's wire form, written from its msgpack_numpy module ------------------------------------

def _pack(obj):
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return obj


def _unpack(obj):
    if b"__ndarray__" in obj:
        return np.ndarray(buffer=obj[b"data"], dtype=np.dtype(obj[b"dtype"]), shape=obj[b"shape"])
    return obj


def packb(obj) -> bytes:
    return msgpack.packb(obj, default=_pack)


def unpackb(data: bytes):
    return msgpack.unpackb(data, object_hook=_unpack)


# -- observations as openpi's examples send them ----------------------------------------------------------

def _image(seed: int, size=(40, 52)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def libero(seed: int = 0) -> dict:
    return {"observation/image": _image(seed), "observation/wrist_image": _image(seed + 1),
            "observation/state": np.random.default_rng(seed).uniform(-1, 1, 8), "prompt": "put the bowl on the plate"}


def droid(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"observation/exterior_image_1_left": _image(seed), "observation/wrist_image_left": _image(seed + 2),
            "observation/joint_position": rng.uniform(-1, 1, 7), "observation/gripper_position": rng.uniform(0, 1, 1),
            "prompt": "open the drawer"}


def _tensor(a: np.ndarray) -> dict:
    return {"dtype": str(a.dtype), "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode()}


def native_actions(srv: Server, images, state: np.ndarray, prompt: str, action_dim: int, **extra) -> np.ndarray:
    inputs = {"images": [_tensor(im) for im in images], "state": _tensor(state.astype(np.float64)), "prompt": prompt,
              "action_dim": action_dim, **extra}
    resp = httpx.post(f"{srv.url}/v1/walks/pi05", json={"inputs": inputs, "stream": False}, headers=srv.headers,
                      timeout=60)
    assert resp.status_code == 200, resp.text
    value = resp.json()["outputs"]["actions"]
    return np.frombuffer(base64.b64decode(value["data"]), dtype=value["dtype"]).reshape(value["shape"])


@pytest.fixture(scope="module")
def srv():
    server = Server(["pi05"])
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.serving_output(), server.serving_output()[-3000:]


def _connect(srv: Server, key: str | None = API_KEY):
    headers = {"Authorization": f"Api-Key {key}"} if key else None
    return websockets_sync.connect(f"ws://127.0.0.1:{srv.port}", compression=None, max_size=None,
                                   additional_headers=headers, open_timeout=30)


def _infer(ws, obs) -> dict | str:
    ws.send(packb(obs))
    reply = ws.recv(timeout=60)
    return reply if isinstance(reply, str) else unpackb(reply)


# -- the native endpoint -----------------------------------------------------------------------------------

def test_native_endpoint_actions_have_the_right_shape_and_follow_the_seed(srv):
    images, state = [_image(1), _image(2, (30, 30))], np.linspace(-0.9, 0.9, 6)
    a = native_actions(srv, images, state, "pick up the cube", 7, seed=5, horizon=4)
    b = native_actions(srv, images, state, "pick up the cube", 7, seed=5, horizon=4)
    c = native_actions(srv, images, state, "pick up the cube", 7, seed=6, horizon=4)
    assert a.shape == (4, 7) and a.dtype == np.float32 and np.isfinite(a).all()
    assert np.array_equal(a, b) and np.abs(a - c).max() > 1e-3


# -- the websocket policy protocol ---------------------------------------------------------------------------

def test_metadata_on_connect_then_libero_and_droid_observations_get_actions(srv):
    with _connect(srv) as ws:
        meta = unpackb(ws.recv(timeout=30))
        assert meta["model"] == "pi05" and meta["policy"] == "pi05" and meta["action_horizon"] == 5
        assert "observation/wrist_image" in meta["mappings"]["libero"]
        out = _infer(ws, libero())
        assert isinstance(out, dict) and out["actions"].shape == (5, 7) and out["actions"].dtype == np.float32
        assert out["server_timing"]["infer_ms"] > 0
        out = _infer(ws, droid())
        assert out["actions"].shape == (5, 8) and np.isfinite(out["actions"]).all()


def test_websocket_actions_equal_the_native_endpoints_for_the_same_seed(srv):
    obs = libero(3)
    with _connect(srv) as ws:
        ws.recv(timeout=30)
        got = _infer(ws, obs)["actions"]
    want = native_actions(srv, [obs["observation/image"], obs["observation/wrist_image"]], obs["observation/state"],
                          obs["prompt"], 7, seed=0)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    obs = droid(4)
    with _connect(srv) as ws:
        ws.recv(timeout=30)
        got = _infer(ws, obs)["actions"]
    state = np.concatenate([obs["observation/joint_position"], obs["observation/gripper_position"]])
    want = native_actions(srv, [obs["observation/exterior_image_1_left"], obs["observation/wrist_image_left"]],
                          state, obs["prompt"], 8)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def test_a_malformed_observation_gets_an_error_frame_naming_the_key_and_the_connection_stays_usable(srv):
    with _connect(srv) as ws:
        ws.recv(timeout=30)
        bad = libero()
        del bad["observation/state"]
        reply = _infer(ws, bad)
        assert isinstance(reply, str) and "'observation/state'" in reply and "missing" in reply
        reply = _infer(ws, {**libero(), "observation/wrist_image": np.zeros((8, 8), np.uint8)})
        assert isinstance(reply, str) and "'observation/wrist_image'" in reply and "[H, W, 3]" in reply
        reply = _infer(ws, {**libero(), "observation/state": np.zeros(40)})
        assert isinstance(reply, str) and "'observation/state'" in reply and "at most 32" in reply
        reply = _infer(ws, {**droid(), "prompt": 17})
        assert isinstance(reply, str) and "'prompt'" in reply
        ws.send(packb({"observation/image": {b"__ndarray__": True, b"data": b"\0" * 8, b"dtype": "|O", b"shape": [1]}}))
        reply = ws.recv(timeout=30)
        assert isinstance(reply, str) and "dtype" in reply
        ws.send(b"\xc1 not msgpack")
        assert "msgpack" in ws.recv(timeout=30)
        ws.send("a text frame")
        assert "binary" in ws.recv(timeout=30)
        out = _infer(ws, libero())  # still serving
        assert isinstance(out, dict) and out["actions"].shape == (5, 7)


def test_the_api_key_is_required_when_set(srv):
    from websockets.exceptions import InvalidStatus

    for key in (None, "wrong-key"):
        with pytest.raises(InvalidStatus) as info:
            _connect(srv, key)
        assert info.value.response.status_code == 403
    with websockets_sync.connect(f"ws://127.0.0.1:{srv.port}", open_timeout=30,
                                 additional_headers={"Authorization": f"Bearer {API_KEY}"}) as ws:
        assert unpackb(ws.recv(timeout=30))["model"] == "pi05"


def test_mapping_choice_from_the_environment(monkeypatch, tmp_path):
    from mstar_pi05.checkpoint import tiny_config
    from mstar_pi05.config import PolicyConfig
    from mstar_pi05.policy_ws import ObservationMapping, configured_mapping, pick_mapping
    from mstar_pi05.robots import policy_server

    from mstar_core.errors import ConfigError

    declared = [ObservationMapping.from_dict(n, m) for n, m in
                policy_server(PolicyConfig.from_dict(tiny_config("pi05")))["mappings"].items()]
    assert pick_mapping(droid(), declared).name == "droid" and pick_mapping(libero(), declared).name == "libero"
    monkeypatch.delenv("MSTAR_POLICY_MAPPING", raising=False)
    assert configured_mapping(declared) is None
    monkeypatch.setenv("MSTAR_POLICY_MAPPING", "droid")
    assert configured_mapping(declared).name == "droid"
    own = tmp_path / "aloha.json"
    own.write_text(json.dumps({"fields": {"images": ["cam_high"], "state": "qpos", "prompt": "prompt"},
                               "fixed": {"action_dim": 14}, "optional": {"seed": "seed"}}))
    monkeypatch.setenv("MSTAR_POLICY_MAPPING", str(own))
    mapping = configured_mapping(declared)
    inputs = mapping.inputs({"cam_high": _image(0), "qpos": np.zeros(14), "prompt": "fold", "seed": np.int64(3)},
                            {"images": "array", "state": "tensor", "prompt": "string"})
    assert inputs["action_dim"] == 14 and inputs["seed"] == 3 and len(inputs["images"]) == 1
    own.write_text(json.dumps({"fields": {"images": []}}))
    with pytest.raises(ConfigError, match="fields.images"):
        configured_mapping(declared)
    monkeypatch.setenv("MSTAR_POLICY_MAPPING", "nowhere")
    with pytest.raises(ConfigError, match="neither a declared mapping"):
        configured_mapping(declared)


# -- an unchanged openpi-client, in an environment of its own (it pins numpy < 2) ------------------------------

OPENPI_CLIENT = "openpi-client==0.1.2"
#: openpi-client 0.1.2 imports typing_extensions without declaring it
CLIENT_EXTRAS = ("typing_extensions",)
CLIENT_SCRIPT = """
import sys
import numpy as np
from openpi_client.websocket_client_policy import WebsocketClientPolicy

port, key, obs_path, out_path = sys.argv[1:]
policy = WebsocketClientPolicy("127.0.0.1", int(port), api_key=key)
meta = policy.get_server_metadata()
assert meta["model"] == "pi05", meta
saved = np.load(obs_path)
obs = {k: saved[k] for k in saved.files if k != "prompt"}
obs["prompt"] = str(saved["prompt"])
first = policy.infer(obs)["actions"]
bad = dict(obs)
del bad["observation/wrist_image"]
try:
    policy.infer(bad)
    raise SystemExit("a malformed observation was answered")
except RuntimeError as exc:
    assert "'observation/wrist_image'" in str(exc), exc
again = policy.infer(obs)["actions"]  # the connection survived the error frame
np.save(out_path, np.stack([first, again]))
print("numpy", np.__version__)
"""


def _openpi_venv() -> Path:
    """A venv with openpi-client, built once per machine (reused while it imports)."""
    venv = Path(tempfile.gettempdir()) / f"mstar-{OPENPI_CLIENT.replace('==', '-')}-venv"
    python = venv / "bin" / "python"
    if python.exists() and subprocess.run([python, "-c", "import openpi_client.websocket_client_policy"], capture_output=True).returncode == 0:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
    pip = subprocess.run([python, "-m", "pip", "install", "-q", OPENPI_CLIENT, *CLIENT_EXTRAS], capture_output=True, text=True,
                         timeout=900)
    if pip.returncode != 0:
        pytest.skip(f"cannot install {OPENPI_CLIENT}: {pip.stderr[-500:]}")
    return python


@pytest.mark.slow
def test_an_unchanged_openpi_client_drives_mstar_serve_pi05(srv, tmp_path):
    python = _openpi_venv()
    obs = libero(7)
    np.savez(tmp_path / "obs.npz", **{k: np.asarray(v) for k, v in obs.items()})
    script = tmp_path / "client.py"
    script.write_text(CLIENT_SCRIPT)
    run = subprocess.run([python, script, str(srv.port), API_KEY, tmp_path / "obs.npz", tmp_path / "actions.npy"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "numpy 1." in run.stdout  # the client really ran on its own numpy < 2
    first, again = np.load(tmp_path / "actions.npy")
    assert first.shape == (5, 7) and np.array_equal(first, again)
    want = native_actions(srv, [obs["observation/image"], obs["observation/wrist_image"]], obs["observation/state"],
                          obs["prompt"], 7, seed=0)
    np.testing.assert_allclose(first, want, atol=1e-6, rtol=0)
