"""AsyncEngine: the embedding API. Load models, submit requests, stream their outputs.

It runs inside the caller's event loop (plain asyncio or uvloop) and installs no loop policy.
Tensor work runs on one device thread per engine, so the loop stays responsive.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import torch

from mstar_core.checkpoint.hub import resolve_options
from mstar_core.checkpoint.partial import release_unhosted
from mstar_core.config.lora import LoraSettings
from mstar_core.config.placement import LOCAL, Placement
from mstar_core.errors import ConfigError, RequestCancelled, RequestError, RequestTimeout
from mstar_core.model import LoadedModel, LoadOptions
from mstar_core.plugins.manager import Registry, default_registry
from mstar_core.runtime.admission import Admission, Place
from mstar_core.runtime.conductor import Conductor
from mstar_core.runtime.engine import Engine, EngineContext, active_limit, build_order, call_order
from mstar_core.runtime.host_memory import keep_freed_memory
from mstar_core.runtime.lora import LORA_INPUT, AdapterHost, AdapterRegistry, ServedAdapter
from mstar_core.runtime.placing import PlacementStrategy, node_workers
from mstar_core.runtime.request import RequestHandle
from mstar_core.runtime.scheduler import NodeScheduler
from mstar_core.runtime.stream_admission import StreamAdmission

log = logging.getLogger("mstar.engine")

#: Per-node settings the runtime itself reads; every other setting goes to the node's engine.
RUNTIME_SETTINGS = ("own_thread", "max_active_requests", "call_order", "admit_streams")


class _ModelRuntime:
    def __init__(self, loaded: LoadedModel, engines: dict[str, Engine], schedulers: dict[str, Any],
                 walk_schedulers: dict[tuple[str, str], Any] | None = None, borrowed: set[str] | None = None):
        self.loaded = loaded
        self.engines = engines
        self.schedulers = schedulers
        #: nodes served by another model's engines and schedulers (a composed model's parts): that model owns them
        self.borrowed = set(borrowed or ())
        self.walk_schedulers = dict(walk_schedulers or {})
        self.conductor = Conductor(loaded.graph, schedulers, walk_schedulers)


class AsyncEngine:
    """Serve one or more models in this process.

    `max_running` caps requests executing at once; up to `max_queued` more wait for a slot, and
    beyond that `submit` raises `RequestError(status=503)` so callers can shed load.

    Embedding it changes nothing process-wide: no event loop policy, and torch's global thread
    count stays as the caller left it unless `torch_threads` is given (a number, or "share" to split
    the cores evenly with the worker processes a placement spawns here, as `mstar serve` does).
    """

    def __init__(
        self,
        registry: Registry | None = None,
        *,
        device: str | torch.device = "cpu",
        max_running: int = 256,
        max_queued: int = 1024,
        worker: str = "local",
        torch_threads: int | str | None = None,
        placement_strategy: PlacementStrategy | None = None,
    ):
        self.registry = registry if registry is not None else default_registry()
        if torch_threads is not None and torch_threads != "share":
            torch.set_num_threads(max(1, int(torch_threads)))
        self.torch_threads = torch_threads
        self.device = torch.device(device)
        self.worker = worker
        self.admission = Admission(max_running, max_queued)
        self._models: dict[str, _ModelRuntime] = {}
        keep_freed_memory()  # the device thread's forwards reuse their pages instead of faulting them in again
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mstar-device-{worker}")
        self._slots: asyncio.Semaphore | None = None
        self._ids = itertools.count()
        self._id_prefix = f"{os.getpid():x}-{uuid.uuid4().hex[:6]}"
        self._handles: dict[str, RequestHandle] = {}
        self.placement_strategy = placement_strategy  # runs the nodes a placement puts in other processes
        self._lost: dict[str, Exception] = {}  # request id -> why its state was lost (see `fail_requests`)
        self._own_executors: list[ThreadPoolExecutor] = []  # nodes with `own_thread`
        #: LoRA adapters served by name over the models that take them (`enable_lora`, `load_lora_adapter`)
        self.lora = AdapterRegistry()

    # -- models --------------------------------------------------------------------------------

    async def load_model(
        self,
        name: str,
        options: LoadOptions | None = None,
        settings: Mapping[str, Mapping[str, Any]] | None = None,
        alias: str | None = None,
        placement: Placement | None = None,
    ) -> LoadedModel:
        """Load a registered model family (weights loaded off the event loop) and start its engines.

        With a `placement`, nodes it assigns to workers run in worker processes (spawned here, or
        joining from other hosts); the rest run in this process. When no node stays here, this
        process builds the model on the meta device: the graph and request preparation without
        the weights, which only the workers load.
        """
        spec = self.registry.models.get(name)
        if placement is not None and placement.remote and self.placement_strategy is None:
            raise ConfigError(f"{placement.source}: the placement puts nodes on workers, but this AsyncEngine was "
                              "built without a placement strategy; pass placement_strategy="
                              "mstar_core.cluster.strategy.WorkerPlacement() (or build it with placed_engine())")
        options = options or LoadOptions(device=str(self.device))
        loop = asyncio.get_running_loop()
        # a Hub id becomes a directory in the Hub cache (downloaded if need be) before the model sees it; workers
        # are sent the id as given and resolve it in their own environment (their host's cache)
        local = await loop.run_in_executor(self._executor, resolve_options, options)
        if placement is not None and placement.remote:
            loaded = await loop.run_in_executor(self._executor, self._load_local_part, spec, local, placement)
        else:
            loaded = await loop.run_in_executor(self._executor, spec.load, local)
        if placement is None or not placement.remote:
            if placement is not None:
                placement.check_nodes(name, loaded.graph.nodes)
                settings = {**placement.engine_settings, **(settings or {})}
            return await self.add_model(loaded, settings=settings, alias=alias)
        return await self._add_placed_model(spec.name, loaded, options, placement, settings or {}, alias)

    @staticmethod
    def _load_local_part(spec: Any, options: LoadOptions, placement: Placement) -> LoadedModel:
        """Build the model once with the weights of the nodes that run in this process only.

        Nodes the placement sends to workers are built on the meta device (`LoadOptions.remote`). A node
        placed per walk runs here if any of its walks does, which only the graph tells: then the model is
        first built on the meta device (no weights read) to learn its walks. A model that ignores
        `LoadOptions` has the other nodes' weights released afterwards.
        """
        if placement.walks:
            loaded = spec.load(attrs.evolve(options, device="meta"))
            here = tuple(n for n, workers in node_workers(loaded.graph, placement).items() if LOCAL in workers)
            if not here:
                return loaded
            loaded = spec.load(attrs.evolve(options, nodes=here))
        else:
            loaded = spec.load(attrs.evolve(options, remote=tuple(n for n, w in placement.nodes.items() if w != LOCAL)))
        here = tuple(n for n, workers in node_workers(loaded.graph, placement).items() if LOCAL in workers)
        release_unhosted(loaded.graph, here)
        return loaded

    async def _add_placed_model(self, family, loaded, options, placement, settings, alias) -> LoadedModel:
        name = alias or loaded.name
        placement.check_nodes(name, loaded.graph.nodes)
        placement.check_walks(name, loaded.graph.walks)
        placed = await self.placement_strategy.place(self, family, loaded, options, placement, settings)
        runtime = _ModelRuntime(loaded, placed.engines, placed.schedulers, placed.walk_schedulers)
        if placed.attach is not None:
            placed.attach(runtime.conductor)
        self._models[name] = runtime
        return loaded

    # -- what a placement strategy borrows (`PlacementHost`) -----------------------------------

    async def build_local(self, loaded: LoadedModel, settings: Mapping[str, Mapping[str, Any]],
                          nodes: set[str]) -> dict[str, Engine]:
        """This process's engines for `nodes` of a placed model, built on the device thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._build_engines, loaded, settings, nodes)

    def fail_requests(self, request_ids: Iterable[str], error: Callable[[], Exception]) -> None:
        """Their state was lost (a worker died or hung): they fail now with `error()`, even those not waiting on it."""
        for rid in request_ids:
            handle = self._handles.get(rid)
            if handle is not None and not handle.done:
                self._lost[rid] = error()
                handle.cancel()

    @property
    def cluster(self) -> Any:
        """The placement strategy's worker processes, if it has any (metrics and tests read them)."""
        return getattr(self.placement_strategy, "cluster", None)

    def local_scheduler(self, engine: Engine) -> NodeScheduler:
        """A node's scheduler, on the shared device thread or, with the setting `own_thread`, its own.

        A thread of its own lets a node's steps overlap another node's (a codec decoding windows
        while the LM decodes the next tokens); on a GPU that is what a second CUDA stream buys.
        """
        if not engine.own_thread:
            return NodeScheduler(engine, self._executor)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mstar-device-{engine.node.name}")
        self._own_executors.append(executor)
        return NodeScheduler(engine, executor)

    async def add_model(
        self,
        loaded: LoadedModel,
        settings: Mapping[str, Mapping[str, Any]] | None = None,
        alias: str | None = None,
    ) -> LoadedModel:
        """Serve an already built `LoadedModel` (models built in process, tests)."""
        name = alias or loaded.name
        if name in self._models:
            raise ValueError(f"a model named '{name}' is already loaded; pass alias=")
        settings = dict(settings or {})
        unknown = set(settings) - set(loaded.graph.nodes)
        if unknown:
            raise RequestError(
                f"engine settings name unknown nodes {sorted(unknown)}; nodes of '{name}': {sorted(loaded.graph.nodes)}"
            )
        loop = asyncio.get_running_loop()
        engines = await loop.run_in_executor(self._executor, self._build_engines, loaded, settings)
        schedulers = {n: self.local_scheduler(e) for n, e in engines.items()}
        self._models[name] = _ModelRuntime(loaded, engines, schedulers)
        return loaded

    async def compose(self, name: str, composition: str, parts: Mapping[str, str],
                      settings: Mapping[str, Mapping[str, Any]] | None = None,
                      options: Mapping[str, Any] | None = None) -> LoadedModel:
        """Serve a model built from loaded models' nodes: `composition` (a registered `CompositionSpec`) with each of
        its roles filled by a loaded model's name, e.g. `compose("agent", "voice_agent", {"asr": "whisper", "llm":
        "llama", "tts": "qwen3-tts"})`.

        The parts' nodes run on the parts' own engines and schedulers: no second copy of any weight or KV pool, and a
        composed request's calls batch with the standalone models' requests. Only the composition's own (glue) nodes
        get engines of their own; `settings` may tune those. `options`: the composition's own
        (`CompositionSpec.options`, e.g. the voice agent's text chunk policy).
        """
        from mstar_core.compose.spec import check_roles
        from mstar_core.graph.compose import NODE_SEP

        spec = self.registry.compositions.get(composition)
        check_roles(spec, parts, f"models.{name}", options)
        if name in self._models:
            raise ConfigError(f"a model named '{name}' is already loaded; name the composition otherwise")
        runtimes = {role: self._part_runtime(name, role, model) for role, model in parts.items()}
        loaded = spec.build(name, {role: rt.loaded for role, rt in runtimes.items()}, dict(options or {}))
        loaded.extras["parts"] = dict(parts)
        engines: dict[str, Engine] = {}
        schedulers: dict[str, Any] = {}
        for node in loaded.graph.nodes:
            role, sep, inner = node.partition(NODE_SEP)
            if sep and role in runtimes:
                # wherever the part's placement put the node (this process or a worker; a node placed per walk: its
                # default scheduler), the composed model's calls go where the standalone model's go
                schedulers[node] = runtimes[role].schedulers[inner]
                if inner in runtimes[role].engines:  # (a node placed on a worker has its engine there)
                    engines[node] = runtimes[role].engines[inner]
        own = set(loaded.graph.nodes) - set(schedulers)
        unknown = set(settings or {}) - own
        if unknown:
            raise ConfigError(f"engine settings of composed model '{name}' name {sorted(unknown)}; only its own nodes "
                              f"take settings ({sorted(own)}): tune a part's nodes on the part's model")
        built = await self.build_local(loaded, settings or {}, own)
        engines.update(built)
        schedulers.update({n: self.local_scheduler(e) for n, e in built.items()})
        self._models[name] = _ModelRuntime(loaded, engines, schedulers, borrowed=set(loaded.graph.nodes) - own)
        return loaded

    def _part_runtime(self, name: str, role: str, model: str) -> _ModelRuntime:
        runtime = self._models.get(model)
        if runtime is None:
            known = ", ".join(sorted(self._models)) or "none"
            raise ConfigError(f"models.{name}.{role}: model '{model}' is not loaded (load it first, in the same deploy "
                              f"file); loaded: {known}")
        if runtime.loaded.name in self.registry.compositions or "composition" in (runtime.loaded.extras or {}):
            raise ConfigError(f"models.{name}.{role}: model '{model}' is itself composed; compose loaded models")
        return runtime

    def _build_engines(
        self, loaded: LoadedModel, settings: Mapping[str, Mapping[str, Any]], only: set[str] | None = None
    ) -> dict[str, Engine]:
        engines: dict[str, Engine] = {}
        for name in build_order(loaded.graph, loaded.graph.nodes if only is None else only):
            node = loaded.graph.nodes[name]
            engine_cls = self.registry.engines.get(node.engine)
            merged = {**loaded.engine_settings.get(node.name, {}), **settings.get(node.name, {})}
            # settings the runtime consumes are not the engine's (engines check theirs strictly)
            runtime_settings = {key: merged.pop(key) for key in RUNTIME_SETTINGS if key in merged}
            context = EngineContext(self.worker, self.device, merged, self.registry, peers=dict(engines))
            module = node.module() if node.module is not None else None
            engines[node.name] = engine = engine_cls(node, module, context)
            engine.own_thread = bool(runtime_settings.get("own_thread", False))
            engine.max_active_requests = active_limit(name, runtime_settings.get("max_active_requests"))
            engine.call_order = call_order(name, runtime_settings.get("call_order"))
            engine.admit_streams = StreamAdmission.from_setting(name, runtime_settings.get("admit_streams"))
        return engines

    @property
    def max_running(self) -> int:
        return self.admission.max_running

    @property
    def max_queued(self) -> int:
        return self.admission.max_queued

    @property
    def running(self) -> int:
        return self.admission.running

    @property
    def waiting(self) -> int:
        """Requests holding a queued place: waiting for a slot, or still being prepared by a server."""
        return self.admission.waiting

    @property
    def models(self) -> dict[str, LoadedModel]:
        return {name: rt.loaded for name, rt in self._models.items()}

    def _runtime(self, model: str) -> _ModelRuntime:
        try:
            return self._models[model]
        except KeyError:
            known = ", ".join(sorted(self._models)) or "none"
            raise RequestError(f"model '{model}' is not loaded; loaded models: {known}", status=404) from None

    def node_engines(self, model: str) -> dict[str, Engine]:
        return dict(self._runtime(model).engines)

    def node_schedulers(self, model: str) -> dict[str, NodeScheduler]:
        return dict(self._runtime(model).schedulers)

    # -- requests ------------------------------------------------------------------------------

    def submit(
        self,
        model: str,
        inputs: Mapping[str, Any],
        *,
        timeout: float | None = None,
        request_id: str | None = None,
        prepared: bool = False,
        place: Place | None = None,
        priority: float = 0.0,
    ) -> RequestHandle:
        """Start a request; returns its handle at once. Bad input raises `RequestError` here.

        Preparation (`prepared=False`) runs inline, on the caller's thread; servers use `submit_async`
        (or `await prepare(...)` then `prepared=True`) so a large upload does not stall other streams.
        A server takes the request's `place` (`admission.take()`) before its first await and passes
        it here; the request then owns it (given back when it ends, or here if it cannot start).
        Without one, a place is taken now; `AtCapacity` (503) when none is free.
        `priority` is the request's class under its calls' own ranks: 0 for live traffic,
        `runtime.engine.BACKGROUND_PRIORITY` for work that may wait (schedulers serve it after live calls).

        `model` may name a LoRA adapter: the request runs on its base model, under the adapter.
        """
        model, adapter = self.lora.resolve(model)
        runtime = self._runtime(model)
        place = self.admission.take() if place is None else place
        try:
            return self._start(runtime, model, inputs, timeout, request_id, prepared, place, priority, adapter)
        except BaseException:
            place.release()
            raise

    def _start(self, runtime: _ModelRuntime, model: str, inputs: Mapping[str, Any], timeout: float | None,
               request_id: str | None, prepared: bool, place: Place, priority: float = 0.0,
               adapter: str | None = None) -> RequestHandle:
        if place.released:
            raise ValueError("a released admission place cannot start a request")
        env = dict(inputs) if prepared else runtime.loaded.prepare_inputs(inputs)
        if adapter is not None:  # (set after preparing: a model's request schema knows nothing of adapters)
            env[LORA_INPUT] = adapter
        graph = runtime.loaded.graph
        try:
            walks = graph.plan(env)
        except (KeyError, ValueError, TypeError) as exc:
            raise RequestError(f"cannot plan the request: {exc.args[0] if exc.args else exc}") from None
        missing = [n for n in graph.walks[walks[0]].inputs if n not in env] if walks else []
        if missing:
            raise RequestError(f"walk '{walks[0]}' of model '{model}' needs inputs {missing}; got {sorted(env)}")
        self._check_workers(runtime)
        rid = request_id or f"{self._id_prefix}-{next(self._ids)}"
        if rid in self._handles:
            raise RequestError(f"request id '{rid}' is already in use")
        handle = RequestHandle(rid, model)
        self._handles[rid] = handle
        task = asyncio.get_running_loop().create_task(self._run(runtime, handle, env, timeout, place, walks, priority),
                                                      name=f"mstar-req-{rid}")
        handle._attach(task)
        return handle

    @staticmethod
    def _check_workers(runtime: _ModelRuntime) -> None:
        """Refuse a new request up front (503, retryable) while a node it may need has no ready worker.

        Admitted, it would start (an HTTP route may already have sent its 200) and then fail when
        it reaches that node: a truncated answer instead of a clean retry.
        """
        for scheduler in [*runtime.schedulers.values(), *runtime.walk_schedulers.values()]:
            check = getattr(scheduler, "check_available", None)  # a node in another process may have none ready
            if check is not None:
                check()

    async def _run(self, runtime: _ModelRuntime, handle: RequestHandle, env: dict, timeout: float | None,
                   place: Place, plan: list[str], priority: float = 0.0) -> dict:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_running)
        try:
            async with asyncio.timeout(timeout):
                async with self._slots:
                    place.start()
                    try:
                        # the plan computed and checked at submission (one plan per request)
                        return await runtime.conductor.run(handle.request_id, env, handle._emit, handle.walks,
                                                           credit=handle.credit, plan=plan, priority=priority)
                    finally:
                        place.release()  # before the slot goes to the next waiter: the count never dips
        except TimeoutError:
            raise RequestTimeout(f"request {handle.request_id} ran past its {timeout}s timeout") from None
        except asyncio.CancelledError:
            lost = self._lost.pop(handle.request_id, None)
            if lost is not None:
                raise lost from None
            raise
        finally:
            place.release()
            self._handles.pop(handle.request_id, None)
            self._lost.pop(handle.request_id, None)

    async def prepare(self, model: str, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """A request's prepared env (tokenization, audio/image decoding, resizing), computed off the event loop.

        A large upload then costs a worker thread, not every other request's stream. Raises what
        the model's `prepare` raises (a `RequestError` says what to fix).
        """
        loaded = self._runtime(self.lora.resolve(model)[0]).loaded
        if loaded.prepare is None and loaded.request_schema is None:
            return dict(inputs)
        return await asyncio.to_thread(loaded.prepare_inputs, inputs)

    async def submit_async(self, model: str, inputs: Mapping[str, Any], **kw: Any) -> RequestHandle:
        """`submit`, with the request prepared off the event loop first (what a server should call)."""
        return self.submit(model, await self.prepare(model, inputs), prepared=True, **kw)

    async def generate(self, model: str, inputs: Mapping[str, Any], **kw: Any) -> dict[str, Any]:
        """Submit (prepared off the event loop) and wait for the final env."""
        if kw.get("prepared"):
            return await self.submit(model, inputs, **kw).result()
        return await (await self.submit_async(model, inputs, **kw)).result()

    def cancel(self, request_id: str) -> bool:
        handle = self._handles.get(request_id)
        if handle is None:
            return False
        handle.cancel()
        return True

    # -- LoRA adapters (mstar_core.runtime.lora) -------------------------------------------------

    def _adapter_hosts(self, model: str) -> list[tuple[Any, AdapterHost]]:
        """(scheduler, engine) of every node of `model` that takes the input `lora`; a ConfigError if one cannot."""
        runtime = self._runtime(model)
        hosts = []
        for name, node in runtime.loaded.graph.nodes.items():
            if LORA_INPUT not in node.optional_inputs:
                continue
            engine = runtime.engines.get(name)
            if not isinstance(engine, AdapterHost):
                where = "runs in a worker process" if engine is None else f"runs on the {node.engine} engine"
                raise ConfigError(f"model '{model}': node '{name}' takes LoRA adapters but {where}, which cannot "
                                  "load them; serve that node in the serving process")
            hosts.append((runtime.schedulers.get(name), engine))
        if not hosts:
            raise ConfigError(f"model '{model}' has no node that takes LoRA adapters (none declares the optional "
                              f"input '{LORA_INPUT}')")
        return hosts

    async def _on_device(self, scheduler: Any, fn: Callable[[], Any]) -> Any:
        """Run `fn` where the node's steps run, between two of them, after the releases already asked for."""
        if scheduler is None:
            return fn()
        return await scheduler.between_steps(fn)

    async def enable_lora(self, model: str, settings: LoraSettings | None = None) -> None:
        """Let `model`'s adapter-taking nodes hold adapters within `settings`' bounds, and load its named adapters."""
        settings = settings or LoraSettings()
        hosts = self._adapter_hosts(model)
        for scheduler, engine in hosts:
            await self._on_device(scheduler, lambda e=engine: e.enable_lora(settings.max_loras, settings.max_lora_rank))
        self.lora.enabled[model] = settings
        for name, path in settings.adapters.items():
            await self.load_lora_adapter(name, path, model=model)

    async def load_lora_adapter(self, name: str, path: str, *, model: str | None = None) -> ServedAdapter:
        """Serve the PEFT adapter directory `path` as model `name` over `model` (default: the one model that takes
        adapters). A bad directory is a `ConfigError` naming it; a taken name a `RequestError`."""
        base = self.lora.base_for_load(model)
        if not isinstance(name, str) or not name or name in self._models or name in self.lora.adapters:
            raise RequestError(f"'{name}' is already the name of a served model or adapter; pick another lora_name",
                               status=400, param="lora_name")
        done: list[Any] = []
        try:
            for scheduler, engine in self._adapter_hosts(base):
                await self._on_device(scheduler, lambda e=engine: e.load_lora(name, str(path)))
                done.append((scheduler, engine))
        except BaseException:
            for scheduler, engine in done:  # all nodes or none
                await self._on_device(scheduler, lambda e=engine: e.unload_lora(name))
            raise
        served = self.lora.adapters[name] = ServedAdapter(name, base, str(path))
        return served

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter `name` and free its slots (a 409 `RequestError` while a request runs under it)."""
        served = self.lora.adapters.get(name)
        if served is None:
            raise RequestError(f"no LoRA adapter named '{name}' is loaded; loaded: {sorted(self.lora.adapters) or 'none'}",
                               status=404, param="lora_name")
        for scheduler, engine in self._adapter_hosts(served.base):
            await self._on_device(scheduler, lambda e=engine: e.unload_lora(name))
        del self.lora.adapters[name]

    def node_stats(self, model: str) -> list[tuple[str, str, dict[str, Any]]]:
        """(node, worker, gauges) for every engine of a model: local ones, and those in workers (last heartbeat)."""
        runtime = self._runtime(model)
        out = [(node, self.worker, _safe_stats(eng))
               for node, eng in runtime.engines.items() if node not in runtime.borrowed]  # (reported by their owner)
        seen = set()
        own = [s for node, s in runtime.schedulers.items() if node not in runtime.borrowed]
        for sched in [*own, *runtime.walk_schedulers.values()]:
            if not hasattr(sched, "replicas") or id(sched) in seen:
                continue
            seen.add(id(sched))
            for replica, stats in sched.stats().items():
                out.append((sched.node, replica, stats if isinstance(stats, dict) else {}))
        return out

    def stats(self) -> dict[str, Any]:
        """Request counts and every engine's gauges, by model and node."""
        return {
            "running": self.running,
            "waiting": self.waiting,
            "models": {
                name: {node: eng.stats() for node, eng in rt.engines.items() if node not in rt.borrowed}
                for name, rt in self._models.items()
            },
        }

    async def close(self) -> None:
        """Cancel in-flight requests, stop the schedulers, free the engines (idempotent)."""
        for handle in list(self._handles.values()):
            handle.cancel()
        for handle in list(self._handles.values()):
            try:
                await handle.result()
            except (RequestCancelled, Exception):
                pass
        for rt in self._models.values():
            for node, sched in rt.schedulers.items():
                if node not in rt.borrowed:  # (a composed model's parts close with the models that own them)
                    await sched.close()
            for node, eng in rt.engines.items():
                if node not in rt.borrowed:
                    eng.close()
        self._models.clear()
        if self.placement_strategy is not None:
            await self.placement_strategy.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        for executor in self._own_executors:
            executor.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _safe_stats(engine: Engine) -> dict[str, Any]:
    try:
        return dict(engine.stats() or {})
    except Exception:  # gauges must never fail a scrape
        return {}

