"""Placement files: which worker process runs which node, with what engine settings.

```yaml
workers:
  codec: {device: cpu, threads: 1}        # spawned on this host; torch threads (default: a core share)
  lm: {device: cuda:0, replicas: 2}        # two processes; a request sticks to one replica
  far: {device: cuda:0, host: 10.0.0.7}    # joins by hand: `mstar worker --join ... --name far`
  big: {device: cuda:0, launcher: ray, num_cpus: 2}  # one Ray actor per replica on a Ray cluster
  snac: {transport: shm}                    # tensors above 64 KiB through a shared-memory arena
  tp: {device: cuda:0, tensor_parallel: 2}  # one node split over 2 rank processes on cuda:0 and cuda:1
  # tp: {devices: [cuda:0, cuda:2], tensor_parallel: 2, replicas: 2}  # 2 groups of 2 ranks (4 processes)
  # tp: {device: cpu, tensor_parallel: 2, threads: 1}  # on CPU: 2 processes with 1 torch thread each
  vae: {device: cuda:1, transport: nccl}    # tensors over torch.distributed (NCCL on CUDA, gloo on CPU)
  # vae: {transport: {name: nccl, backend: gloo, threshold: 16384}}   # a transport's options
nodes:
  snac: codec                              # nodes not listed run in the serving process
  # lm: {prefill: far, decode: lm}         # per walk: the request's KV pages move between them
engine_settings:
  lm: {num_pages: 4096, page_size: 16}
control:
  bind: tcp://127.0.0.1:0                  # default: an IPC socket in a private directory; another host's
                                           # address (e.g. tcp://10.0.0.2:7100) needs MSTAR_SECRET, encrypts
  encrypt: true                            # CURVE on the control link (default: when bind is not loopback/IPC)
  heartbeat_interval: 0.2                  # a worker silent for 5 beats (at least 1 s) is hung: killed, replaced
  ray_address: auto                        # default: a Ray cluster on this machine, or a new local one
  delegate_loops: true                     # loops whose nodes all live on one worker run there (default)
```

`launcher` is `spawn` (a subprocess here; the default), `ray` (an actor on a Ray cluster), or
`manual` (implied by `host`: the worker joins by hand). `transport` names the registered transport
(`mstar plugins` lists them) that carries the tensors between the server and the worker: `zmq` (the
control socket itself; the default), `shm` (shared memory; spawned workers only), or a plugin's.
Control messages always travel on the ZeroMQ control socket.

`tensor_parallel: N` (or `expert_parallel: N` for a mixture-of-experts node: the experts split across
the same N ranks) makes each replica a group of N rank processes sharing one node: rank 0 is the
worker the server talks to, ranks 1..N-1 follow its steps over a torch.distributed group (gloo on CPU,
NCCL on CUDA). `device: cuda:K` puts the ranks on cuda:K..K+N-1; `devices` lists them. A dead or
hung rank takes its whole group down, and the group is replaced as one.

A node placed per walk runs each listed walk on that walk's worker (walks not listed run in the
serving process); when a request's next call lands on another worker, its engine state moves
there first (the engine must support it: `kvcache` does). The same model runs colocated (no file,
or no `nodes`) or disaggregated by changing only this file. Unknown keys, nodes, walks and
workers are errors that name the key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import yaml

from mstar_core.errors import ConfigError
from mstar_core.strict import reject_unknown

LOCAL = "local"
PLACEMENT_KEYS = frozenset({"workers", "nodes", "engine_settings", "control"})
WORKER_KEYS = ("device", "devices", "host", "replicas", "transport", "launcher", "num_cpus", "threads",
               "tensor_parallel", "expert_parallel")
LAUNCHERS = ("spawn", "ray", "manual")


def _check_keys(where: str, data: Any, allowed: Iterable[str]) -> dict:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    if not isinstance(allowed, _AnyKey):
        allowed = set(allowed)
    if isinstance(allowed, _AnyKey):
        for key in data:
            if key not in allowed:
                raise ConfigError(f"{where}: keys must be names (strings), got {key!r}")
    else:
        reject_unknown(data, allowed, where)
    return dict(data)


@attrs.frozen
class WorkerSpec:
    """One worker group: its device, launcher, host (manual workers), replica count and transport."""

    name: str
    device: str = "cpu"
    host: str | None = None
    replicas: int = 1
    transport: str = "zmq"
    #: the transport's options from `transport: {name: ..., key: value}`, as sorted (key, value) pairs
    transport_options: tuple[tuple[str, Any], ...] = ()
    launcher: str = "spawn"
    num_cpus: float = 1.0
    ray_address: str | None = None  # from `control.ray_address`; used by the ray launcher only
    #: torch intra-op threads of each spawned process; None = an even share of this host's cores
    threads: int | None = None
    #: ranks each replica's nodes are split across (heads / columns / vocabulary), and how experts split over them
    tensor_parallel: int = 1
    expert_parallel: int = 1
    #: one device per rank (empty: from `device`, see `rank_devices`)
    devices: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    @property
    def group_size(self) -> int:
        """Rank processes per replica (1: an ordinary worker)."""
        return max(self.tensor_parallel, self.expert_parallel)

    def rank_devices(self) -> list[str]:
        """Each rank's device: `devices`, else `device` repeated (CPU) or counted up from it (`cuda:K` .. `cuda:K+N-1`)."""
        if self.devices:
            return list(self.devices)
        kind, _, index = self.device.partition(":")
        if kind == "cpu" or kind == "meta" or self.group_size == 1:
            return [self.device] * self.group_size
        first = int(index or 0)
        return [f"{kind}:{first + i}" for i in range(self.group_size)]

    def rank_names(self, replica: str) -> list[str]:
        """The worker names of one replica's ranks: the replica itself (rank 0), then `<replica>.rank<i>`."""
        return [replica] + [f"{replica}.rank{i}" for i in range(1, self.group_size)]

    @property
    def spawned(self) -> bool:
        """Started (and restarted) by the server itself, as a subprocess or a Ray actor."""
        return self.launcher != "manual"

    @property
    def num_gpus(self) -> int:
        """Accelerators one replica needs (for the Ray launcher's resource request)."""
        return 0 if self.device.split(":")[0] in ("cpu", "meta") else 1

    def replica_names(self) -> list[str]:
        return [self.name] if self.replicas == 1 else [f"{self.name}.{i}" for i in range(self.replicas)]


@attrs.frozen
class Placement:
    """Parsed placement: workers, node -> worker group, per-node engine settings, control socket."""

    workers: Mapping[str, WorkerSpec] = attrs.field(factory=dict)
    nodes: Mapping[str, str] = attrs.field(factory=dict)
    engine_settings: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict)
    bind: str | None = None
    heartbeat_interval: float = 0.2
    source: str = "<dict>"
    #: run a loop whose nodes all live on one worker on that worker (one round trip per loop, not per step)
    delegate_loops: bool = True
    #: node -> walk -> worker, for nodes placed per walk (a request's state moves between the workers)
    walks: Mapping[str, Mapping[str, str]] = attrs.field(factory=dict)
    #: CURVE on the control link; None = exactly when `bind` reaches other hosts (then it cannot be turned off)
    encrypt: bool | None = None

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> Placement:
        top = _check_keys(source, data, PLACEMENT_KEYS)
        control = _check_keys(
            f"{source}: control", top.get("control"),
            ("bind", "heartbeat_interval", "ray_address", "delegate_loops", "encrypt"),
        )
        encrypt = control.get("encrypt")
        if encrypt is not None and not isinstance(encrypt, bool):
            raise ConfigError(f"{source}: control.encrypt must be true or false, got {encrypt!r}")
        bind = control.get("bind")
        if bind is not None and (not isinstance(bind, str) or "://" not in bind):
            raise ConfigError(f"{source}: control.bind must be an address like tcp://10.0.0.2:7100, got {bind!r}")
        delegate = control.get("delegate_loops", True)
        if not isinstance(delegate, bool):
            raise ConfigError(f"{source}: control.delegate_loops must be true or false, got {delegate!r}")
        ray_address = control.get("ray_address")
        if ray_address is not None and not isinstance(ray_address, str):
            raise ConfigError(f"{source}: control.ray_address must be a string (e.g. auto, ray://host:10001)")
        workers = {}
        for name, raw in _check_keys(f"{source}: workers", top.get("workers"), _AnyKey()).items():
            if name == LOCAL:
                raise ConfigError(f"{source}: workers: '{LOCAL}' is reserved for the serving process")
            spec = _check_keys(f"{source}: workers.{name}", raw, WORKER_KEYS)
            replicas = spec.get("replicas", 1)
            if not isinstance(replicas, int) or replicas < 1:
                raise ConfigError(f"{source}: workers.{name}.replicas must be an integer >= 1, got {replicas!r}")
            workers[name] = _worker(source, str(name), spec, replicas, ray_address)
        nodes, walks = {}, {}
        known = ", ".join(sorted(workers)) or "none"
        for node, worker in _check_keys(f"{source}: nodes", top.get("nodes"), _AnyKey()).items():
            if isinstance(worker, dict):  # per walk: {prefill: a, decode: b}; walks not named run here
                for walk, each in _check_keys(f"{source}: nodes.{node}", worker, _AnyKey()).items():
                    if each != LOCAL and each not in workers:
                        raise ConfigError(f"{source}: nodes.{node}.{walk} names unknown worker '{each}'; "
                                          f"workers: {known}, {LOCAL}")
                walks[str(node)] = {str(w): str(each) for w, each in worker.items()}
                nodes[str(node)] = LOCAL
                continue
            if worker != LOCAL and worker not in workers:
                raise ConfigError(f"{source}: nodes.{node} names unknown worker '{worker}'; workers: {known}, {LOCAL}")
            nodes[str(node)] = str(worker)
        settings = {
            str(node): dict(_check_keys(f"{source}: engine_settings.{node}", value, _AnyKey()))
            for node, value in _check_keys(f"{source}: engine_settings", top.get("engine_settings"), _AnyKey()).items()
        }
        interval = control.get("heartbeat_interval", 0.2)
        if not isinstance(interval, int | float) or interval <= 0:
            raise ConfigError(f"{source}: control.heartbeat_interval must be a positive number, got {interval!r}")
        return cls(workers, nodes, settings, bind, float(interval), source, delegate, walks, encrypt)

    def check_nodes(self, model: str, nodes: Iterable[str]) -> None:
        """Every node the file names must exist in the model."""
        known = set(nodes)
        for key in list(self.nodes) + list(self.engine_settings):
            if key not in known:
                raise ConfigError(
                    f"{self.source}: unknown node '{key}' for model '{model}'; nodes: {', '.join(sorted(known))}"
                )

    def check_walks(self, model: str, walks: Iterable[str]) -> None:
        """Every walk a per-walk entry names must exist in the model."""
        known = set(walks)
        for node, by_walk in self.walks.items():
            for walk in by_walk:
                if walk not in known:
                    raise ConfigError(f"{self.source}: nodes.{node} names unknown walk '{walk}' of model '{model}'; "
                                      f"walks: {', '.join(sorted(known))}")

    def worker_of(self, node: str, walk: str | None = None) -> str:
        """Where `node` runs (in `walk`, for nodes placed per walk)."""
        by_walk = self.walks.get(node)
        if by_walk is not None and walk is not None:
            return by_walk.get(walk, LOCAL)
        return self.nodes.get(node, LOCAL)

    @property
    def remote(self) -> bool:
        return any(w != LOCAL for w in self.nodes.values()) or \
            any(w != LOCAL for by_walk in self.walks.values() for w in by_walk.values())


def _worker(source: str, name: str, spec: dict, replicas: int, ray_address: str | None) -> WorkerSpec:
    """Validate one worker entry's launcher, host, transport and resources."""
    where = f"{source}: workers.{name}"
    host = spec.get("host")
    launcher = spec.get("launcher", "manual" if host is not None else "spawn")
    if launcher not in LAUNCHERS:
        raise ConfigError(f"{where}.launcher: unknown launcher {launcher!r}; known: {', '.join(LAUNCHERS)}")
    if host is not None and launcher != "manual":
        raise ConfigError(f"{where}: 'host' means the worker joins by hand; drop it or use launcher: manual, not {launcher}")
    transport, options = spec.get("transport", "zmq"), {}
    if isinstance(transport, Mapping):
        options = {str(k): v for k, v in transport.items()}
        transport = options.pop("name", None)
    if not isinstance(transport, str) or not transport:
        raise ConfigError(f"{where}.transport must be a transport's name (see `mstar plugins`) or "
                          f"{{name: NAME, option: value, ...}}, got {transport!r}")
    num_cpus = spec.get("num_cpus", 1)
    if isinstance(num_cpus, bool) or not isinstance(num_cpus, int | float) or num_cpus < 0:
        raise ConfigError(f"{where}.num_cpus must be a number >= 0, got {num_cpus!r}")
    if "num_cpus" in spec and launcher != "ray":
        raise ConfigError(f"{where}.num_cpus is a Ray resource request; it needs launcher: ray")
    threads = spec.get("threads")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"{where}.threads must be an integer >= 1, got {threads!r}")
    if threads is not None and launcher != "spawn":
        raise ConfigError(f"{where}.threads sets a spawned process's torch threads; it needs launcher: spawn")
    tensor_parallel, expert_parallel, devices = _rank_group(where, spec, launcher)
    device = str(spec.get("device", devices[0] if devices else "cpu"))
    return WorkerSpec(name=name, device=device, host=host, replicas=replicas,
                      transport=transport, transport_options=tuple(sorted(options.items())), launcher=launcher,
                      num_cpus=float(num_cpus), ray_address=ray_address,
                      threads=threads, tensor_parallel=tensor_parallel, expert_parallel=expert_parallel,
                      devices=devices)


def _rank_group(where: str, spec: dict, launcher: str) -> tuple[int, int, tuple[str, ...]]:
    """`tensor_parallel`, `expert_parallel` and `devices` checked: positive sizes, one group size, a device per rank."""
    sizes = {}
    for key in ("tensor_parallel", "expert_parallel"):
        value = spec.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{where}.{key} must be an integer >= 1, got {value!r}")
        sizes[key] = value
    tp, ep = sizes["tensor_parallel"], sizes["expert_parallel"]
    if tp > 1 and ep > 1 and tp != ep:
        raise ConfigError(f"{where}: expert_parallel ({ep}) splits the experts over the same ranks as tensor_parallel "
                          f"({tp}); give them the same size, or only one of them")
    size = max(tp, ep)
    devices = spec.get("devices")
    if devices is not None:
        if not isinstance(devices, list) or not devices or not all(isinstance(d, str) and d for d in devices):
            raise ConfigError(f"{where}.devices must be a list of device names (e.g. [cuda:0, cuda:2]), got {devices!r}")
        if len(devices) != size:
            raise ConfigError(f"{where}.devices lists {len(devices)} devices for a group of {size} ranks "
                              "(tensor_parallel / expert_parallel); give one device per rank")
        if "device" in spec:
            raise ConfigError(f"{where}: give 'device' (ranks counted up from it) or 'devices', not both")
    if size > 1 and launcher != "spawn":
        raise ConfigError(f"{where}: a group of {size} ranks (tensor_parallel / expert_parallel) is started and "
                          f"replaced as one by this server: it needs launcher: spawn, not {launcher}")
    return tp, ep, tuple(devices or ())


class _AnyKey:
    """Allows every key (for maps keyed by user names)."""

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str)

    def __iter__(self):
        return iter(())


def load_placement(path: str | Path) -> Placement:
    """Read and validate a placement YAML file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"placement file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return Placement.from_dict(data, str(path))
