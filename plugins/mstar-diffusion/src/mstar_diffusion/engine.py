"""`DiffusionEngine` (kind `diffusion`): denoising loops batched across requests, one step at a time.

The loop itself is a `Loop` in the walk; each iteration calls a `role="step"` node once per request.
The engine batches, in one `step()`, the calls of every request currently inside a loop, each row at
its own sigma (requests join and leave between steps: continuous batching of diffusion). It holds
no state for a request between its calls: everything a step needs (latents, step index, settings)
comes with the call, so a request that stops mid-loop leaves nothing behind.

Two node roles (option `role`):

- `init`: draws the first latents, `N(0, I)` of the request's `latent_shape`, from a
  `torch.Generator` seeded with the request's `seed` (on the CPU, one generator per request, so the
  noise is the same whatever the batch and the device). Outputs `latents`, `timestep` (the first
  step's), `sigma`, `seed` (as declared). It also checks the request's settings, so a bad
  `num_steps` fails the request with a 400 before the walk's `Loop` reads it.
- `step`: one Euler step `x <- x + (sigma[i+1] - sigma[i]) * v` at step index `step`, where `v` is
  the guided velocity. It comes from the node's own module (a DiT called as `module(x, t, **cond)`,
  every request's rows and guidance branches stacked in one forward), or, on a node without a
  module, from inputs `velocity` (and `velocity_uncond`, `velocity_uncond_image` for guidance) that
  another node computed earlier in the same iteration. Outputs `latents` (the next), `timestep` and
  `sigma` (the next step's: what the velocity node takes on its next call), `guided_velocity`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import attrs
import torch

from mstar_core.errors import ModelLoadError, RequestError
from mstar_core.graph.options import check_call_options
from mstar_core.runtime.engine import Engine, EngineContext, Invocation, Result
from mstar_core.strict import reject_unknown
from mstar_diffusion import params
from mstar_diffusion.contract import DenoiserModule, check_denoiser_module
from mstar_diffusion.guidance import Guidance, combine
from mstar_diffusion.schedules import SigmaTable
from mstar_diffusion.solvers import unipc_step
from mstar_diffusion.step_cache import cached_forward, supports_step_cache

SETTINGS = ("max_batch_size", "max_rows", "step_cache_threshold")
INIT_OUTPUTS = ("latents", "timestep", "sigma", "seed")
STEP_OUTPUTS = ("latents", "timestep", "sigma", "guided_velocity", "solver_history", "step_cache")
_BRANCHES = ("cond", "uncond", "uncond_image")

@attrs.define(eq=False)
class _Call:
    """One validated invocation, waiting for the next `step()`."""

    inv: Invocation
    latents: torch.Tensor | None = None  # step: x_t; init: None
    shape: tuple[int, ...] = ()  # init: the latent shape to draw
    seed: int = 0
    sigma: float = 1.0
    sigma_next: float = 0.0
    dt: torch.Tensor | None = None  # float32 sigma_next - sigma, as the reference schedulers compute it
    timestep: torch.Tensor | None = None  # what the module sees for this step (sigma x timestep_scale)
    index: int = 0
    sigmas: torch.Tensor | None = None  # the request's float32 schedule (multistep solvers read earlier sigmas)
    history: torch.Tensor | None = None  # the multistep solver's state from the previous step (solver_history)
    next_timestep: torch.Tensor | None = None
    step_cache: dict = attrs.field(factory=dict)  # branch -> the step cache's state of this request (residual,
    new_step_cache: dict = attrs.field(factory=dict)  # indicator, running sum), in and out
    guidance: Guidance = attrs.field(factory=Guidance)
    velocities: dict[str, torch.Tensor] = attrs.field(factory=dict)  # branch -> velocity (velocity nodes)
    conds: dict[str, dict[str, torch.Tensor]] = attrs.field(factory=dict)  # branch -> module conditioning (DiT)


class DiffusionEngine(Engine):
    """Flow-matching denoising steps for many requests at once (see the module docstring for the node roles)."""

    kind = "diffusion"
    module_contract = DenoiserModule
    # Graph.build checks every option against these (node options included), so a misspelt one fails the build
    call_options = params.CALL_OPTIONS
    node_options = params.KNOWN_OPTIONS - params.CALL_OPTIONS

    def __init__(self, node: Any, module: Any, context: EngineContext):
        super().__init__(node, module, context)
        options = node.options
        self.role = options.get("role", "step")
        params.check_node_options(node, self.role)
        # the walks' calls (graphs built before this plugin was imported were not checked by Graph.build), and
        # only what a call can change: a per-call `schedule` or `role` would be silently ignored
        check_call_options(node.name, self.kind, getattr(node, "call_sites", ()), params.CALL_OPTIONS)
        reject_unknown(context.settings, SETTINGS, f"node '{node.name}' (engine 'diffusion')", what="engine setting")
        self.device = torch.device(context.device)
        self.max_rows = int(context.settings.get("max_rows", 256))
        self.cache_threshold = _cache_threshold(node, context.settings.get("step_cache_threshold"))
        self.timestep_scale = float(options.get("timestep_scale", 1.0))
        self.integer_timesteps = bool(options.get("integer_timesteps", False))
        self.solver = options.get("solver", "euler")
        self.schedule = options.get("schedule", "flow_euler")
        self.template = options.get("latent_shape")
        self.sigmas = SigmaTable()
        self.outputs = set(node.outputs)
        allowed = INIT_OUTPUTS if self.role == "init" else STEP_OUTPUTS
        self._check_ports(allowed)
        self.uses_module = self.role == "step" and "velocity" not in node.all_inputs
        self.uncond_inputs = {
            "uncond": dict(options.get("uncond_inputs") or {}),
            "uncond_image": dict(options.get("uncond_image_inputs") or {}),
        }
        substitutes = {v for m in self.uncond_inputs.values() for v in m.values()}
        self.cond_inputs = tuple(n for n in node.inputs if n not in params.LOOP_INPUTS and n not in params.SETTINGS
                                 and n not in substitutes)
        self.optional_cond = tuple(n for n in node.optional_inputs if n not in params.LOOP_INPUTS
                                   and n not in params.SETTINGS and n not in substitutes)
        if self.uses_module:
            check_denoiser_module(module, node, self.cond_inputs, self.optional_cond)
            self._check_substitutes()
            first = next(iter(module.parameters()), None) if hasattr(module, "parameters") else None
            self.module_dtype = first.dtype if first is not None and first.dtype.is_floating_point else torch.float32
            declared = getattr(module, "dtype", None)  # a module with float32 islands says which dtype it takes
            if isinstance(declared, torch.dtype) and declared.is_floating_point:
                self.module_dtype = declared
            if self.cache_threshold is not None and not supports_step_cache(module):
                raise ModelLoadError(f"node '{node.name}' (engine 'diffusion'): setting step_cache_threshold needs a "
                                     "module with cache_embed / cache_indicator / cache_blocks / cache_head "
                                     "(mstar_diffusion.step_cache.StepCacheableDenoiser)")
            if self.cache_threshold is not None and not {"step_cache"} <= set(node.all_inputs) & set(node.outputs):
                raise ModelLoadError(f"node '{node.name}' (engine 'diffusion'): setting step_cache_threshold carries "
                                     "each request's cached residuals from step to step: declare 'step_cache' as an "
                                     "optional input and an output")
        elif module is not None:
            raise ModelLoadError(f"node '{node.name}' (engine 'diffusion'): a {self.role} node that "
                                 f"{'reads input velocity' if self.role == 'step' else 'draws noise'} takes no module; "
                                 "drop module= (a DiT step node has a module and no 'velocity' input)")
        self.queue: deque[_Call] = deque()
        self.answered: list[Result] = []
        self.stepping: list[_Call] = []  # the calls of the step in progress
        # gauges
        self.num_steps = 0
        self.num_forwards = 0
        self.rows_total = 0
        self.last_rows = 0
        self.max_rows_seen = 0
        self.max_requests_per_step = 0
        self.mixed_sigma_steps = 0
        self.cache_reused_rows = 0
        self.cache_computed_rows = 0

    # -- contract ---------------------------------------------------------------------------------

    def add(self, invocation: Invocation) -> None:
        try:
            call = self._parse(invocation)
        except Exception as exc:  # a bad input answers its own invocation, at the next step
            self.answered.append((invocation, exc))
            return
        self.queue.append(call)

    def has_work(self) -> bool:
        return bool(self.queue) or bool(self.answered)

    def step(self) -> list[Result]:
        results, self.answered = self.answered, []
        take = min(len(self.queue), self.max_batch_size)
        if not take:
            return results
        if take < len(self.queue):  # only some fit: the most urgent, then the oldest requests (stable: FIFO after)
            self.queue = deque(sorted(self.queue, key=lambda c: c.inv.urgency))
        batch = [self.queue.popleft() for _ in range(take)]
        self.stepping = batch  # still held (for stats()) until their results are out
        try:
            return results + self._step(batch)
        finally:
            self.stepping = []

    def _step(self, batch: list[_Call]) -> list[Result]:
        results: list[Result] = []
        self.num_steps += 1
        requests = {c.inv.request_id for c in batch}
        self.max_requests_per_step = max(self.max_requests_per_step, len(requests))
        if len({c.sigma for c in batch}) > 1:
            self.mixed_sigma_steps += 1
        with torch.inference_mode():
            if self.role == "init":
                results.extend(self._noise(c) for c in batch)
            elif self.uses_module:
                results.extend(self._denoise(batch))
            else:
                results.extend(self._update(c, c.velocities) for c in batch)
        return results

    def release(self, request_id: str) -> None:
        self.queue = deque(c for c in self.queue if c.inv.request_id != request_id)
        self.answered = [r for r in self.answered if r[0].request_id != request_id]

    def active_requests(self) -> set[str]:
        return {c.inv.request_id for c in self.queue} | {r[0].request_id for r in self.answered}

    def stats(self) -> dict[str, float]:
        # (read from the event loop while the device thread steps: tuple() copies each container in one go under
        # the GIL, where iterating it in Python could meet it mid-change)
        queued, stepping, answered = tuple(self.queue), tuple(self.stepping), tuple(self.answered)
        held = {c.inv.request_id for c in (*queued, *stepping)} | {r[0].request_id for r in answered}
        return {
            "diffusion_steps": self.num_steps,
            "diffusion_forwards": self.num_forwards,
            "diffusion_rows_total": self.rows_total,
            "diffusion_last_rows": self.last_rows,
            "diffusion_max_rows": self.max_rows_seen,
            "diffusion_max_requests_per_step": self.max_requests_per_step,
            "diffusion_mixed_sigma_steps": self.mixed_sigma_steps,
            "diffusion_queued": len(queued),
            # what this engine holds right now: the calls queued or in the step under way (nothing once a step's
            # results are out: the state travels with each call), so a cancelled job's latents are seen to go
            "diffusion_held_requests": len(held),
            "diffusion_held_bytes": sum(_call_bytes(c) for c in (*queued, *stepping)),
            "diffusion_cache_reused_rows": self.cache_reused_rows,
            "diffusion_cache_computed_rows": self.cache_computed_rows,
        }

    def close(self) -> None:
        self.queue.clear()
        self.answered.clear()

    # -- intake -----------------------------------------------------------------------------------

    def _parse(self, inv: Invocation) -> _Call:
        node, inputs, options = inv.node, inv.inputs, inv.options
        # every call is checked afresh (~30 µs of CPU, BENCHMARKS.md): a request's settings come with each of its calls
        unknown = params.unknown_options(options)
        if unknown:  # a walk's per-call option the engine would otherwise ignore: the model is wrong, not the request
            raise ValueError(f"node '{node}' (engine 'diffusion'): unknown call options {unknown}; "
                             f"known: {', '.join(sorted(params.KNOWN_OPTIONS))}")
        steps = params.num_steps(node, inputs, options)
        shift = params.shift(node, inputs, options)
        guidance = params.guidance(node, inputs, options)
        sigmas = self.sigmas.get(self.schedule, steps, shift)
        exact = self.sigmas.exact(self.schedule, steps, shift)
        if self.role == "init":
            shape = params.latent_shape(node, inputs, options)
            return _Call(inv, shape=shape, seed=params.seed(node, inputs, options), sigma=float(sigmas[0]),
                         guidance=guidance, timestep=self._timestep(exact[0]))
        index = params.step_index(node, inputs.get("step"), steps)
        x = params.latents(node, inputs.get("latents"), self.template)
        call = _Call(inv, latents=x, sigma=float(sigmas[index]), sigma_next=float(sigmas[index + 1]),
                     dt=sigmas[index + 1] - sigmas[index], guidance=guidance, timestep=self._timestep(exact[index]),
                     index=index, sigmas=sigmas)
        call.next_timestep = self._timestep(exact[index + 1])
        if self.solver == "unipc" and index > 0:
            history = inputs.get("solver_history")
            if not isinstance(history, torch.Tensor) or tuple(history.shape) != (3, *x.shape):
                raise RequestError(f"node '{node}': step {index} of the unipc solver needs input 'solver_history' "
                                   f"[3, {', '.join(map(str, x.shape))}] from the previous step", param="solver_history")
            call.history = history
        branches = ["cond"]
        if guidance.text_active(call.sigma):
            branches.append("uncond")
            if guidance.image_active(call.sigma):
                branches.append("uncond_image")
        if self.uses_module:
            call.conds = self._conds(inv, branches, guidance)
            if self.cache_threshold is not None and isinstance(inputs.get("step_cache"), dict) and index > 0:
                call.step_cache = inputs["step_cache"]
        else:
            for branch in branches:
                name = "velocity" if branch == "cond" else f"velocity_{branch}"
                if inputs.get(name) is None:
                    raise RequestError(f"node '{node}': guidance applies at step {index} (sigma {call.sigma:.4g}) but "
                                       f"input '{name}' is missing; send it or lower the guidance scale", param=name)
                call.velocities[branch] = params.latents(node, inputs[name], tuple(x.shape), field=name)
        return call

    def _conds(self, inv: Invocation, branches: list[str], guidance: Guidance) -> dict[str, dict[str, torch.Tensor]]:
        """Each guidance branch's conditioning: the node's inputs, with that branch's substitutes swapped in."""
        node, inputs = inv.node, inv.inputs
        # a request asking for guidance must bring its unconditional inputs, whatever step it starts at
        needed = {"uncond": guidance.scale > 1.0, "uncond_image": guidance.scale > 1.0 and guidance.image_scale > 1.0}
        for branch, wanted in needed.items():
            for source in self.uncond_inputs[branch].values() if wanted else ():
                if inputs.get(source) is None:
                    raise RequestError(f"node '{node}': {'image ' if branch == 'uncond_image' else ''}guidance needs "
                                       f"input '{source}'; send it or set the scale to 1", param=source)
        base = {}
        for name in (*self.cond_inputs, *self.optional_cond):
            if name in inputs:
                base[name] = _tensor(node, name, inputs[name])
        conds = {"cond": base}
        for branch in branches[1:]:
            swapped = dict(base)
            for target, source in self.uncond_inputs[branch].items():
                swapped[target] = _tensor(node, source, inputs[source])
                if swapped[target].shape != base.get(target, swapped[target]).shape:
                    raise RequestError(f"node '{node}': input '{source}' must have the shape of '{target}' "
                                       f"{list(base[target].shape)}, got {list(swapped[target].shape)}", param=source)
            conds[branch] = swapped
        return conds

    # -- work -------------------------------------------------------------------------------------

    def _noise(self, call: _Call) -> Result:
        generator = torch.Generator(device="cpu").manual_seed(call.seed)
        noise = torch.randn(call.shape, generator=generator, dtype=torch.float32).to(self.device)
        out = {"latents": noise, "timestep": call.timestep, "sigma": call.sigma, "seed": call.seed}
        return call.inv, {k: v for k, v in out.items() if k in self.outputs}

    def _timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The module's timestep: the float32 sigma x scale, or the float64 one truncated (`integer_timesteps`)."""
        if self.integer_timesteps:
            return torch.tensor(float(int(sigma.item() * self.timestep_scale)), dtype=torch.float32)
        return sigma.to(torch.float32) * self.timestep_scale

    def _update(self, call: _Call, velocities: dict[str, torch.Tensor]) -> Result:
        try:
            x = call.latents.to(self.device, torch.float32)
            v = combine(call.guidance, call.sigma, *(velocities.get(b) for b in _BRANCHES)).to(self.device, torch.float32)
            out = {"timestep": call.next_timestep, "sigma": call.sigma_next, "guided_velocity": v}
            if "step_cache" in self.outputs:
                out["step_cache"] = call.new_step_cache
            if self.solver == "unipc":
                history = None if call.history is None else call.history.to(self.device, torch.float32)
                out["latents"], out["solver_history"] = unipc_step(call.sigmas, call.index, x, v, history)
            else:
                out["latents"] = x + call.dt.to(self.device) * v
        except Exception as exc:
            return call.inv, exc
        return call.inv, {k: val for k, val in out.items() if k in self.outputs}

    def _denoise(self, batch: list[_Call]) -> list[Result]:
        """Every call's branches as rows of as few forwards as shapes allow; each call then takes its own step."""
        groups: dict[tuple, list[tuple[_Call, str]]] = {}
        for call in batch:
            for branch, cond in call.conds.items():
                key = (tuple(call.latents.shape),
                       tuple((n, tuple(t.shape), t.dtype) for n, t in sorted(cond.items())))
                groups.setdefault(key, []).append((call, branch))
        velocities: dict[int, dict[str, torch.Tensor]] = {id(c): {} for c in batch}
        failed: dict[int, BaseException] = {}
        for rows in groups.values():
            for start in range(0, len(rows), self.max_rows):
                chunk = rows[start:start + self.max_rows]
                try:
                    out = self._forward(chunk)
                except Exception:
                    out = None
                if out is not None:
                    for (call, branch), v in zip(chunk, out, strict=True):
                        velocities[id(call)][branch] = v
                    continue
                # a forward that raised: run each call's rows alone, so only the culprit fails
                for call in {id(c): c for c, _ in chunk}.values():
                    mine = [(c, b) for c, b in chunk if c is call]
                    try:
                        for (c, b), v in zip(mine, self._forward(mine), strict=True):
                            velocities[id(c)][b] = v
                    except Exception as exc:
                        failed[id(call)] = exc
        return [(c.inv, failed[id(c)]) if id(c) in failed else self._update(c, velocities[id(c)]) for c in batch]

    def _forward(self, rows: list[tuple[_Call, str]]) -> list[torch.Tensor]:
        x = torch.stack([c.latents for c, _ in rows]).to(self.device, self.module_dtype)
        t = torch.stack([c.timestep for c, _ in rows]).to(self.device)
        names = rows[0][0].conds[rows[0][1]].keys()
        cond = {n: _to(torch.stack([c.conds[b][n] for c, b in rows]), self.device, self.module_dtype) for n in names}
        self.num_forwards += 1
        self.last_rows = len(rows)
        self.rows_total += len(rows)
        self.max_rows_seen = max(self.max_rows_seen, len(rows))
        if self.cache_threshold is None:
            v = self.module(x, t, **cond)
        else:
            states = [c.step_cache.get(b) for c, b in rows]
            # one decision per request (its rows share it); its last step always computes (it is the output)
            requests = [id(c) for c, _ in rows]
            last = [c.index == len(c.sigmas) - 2 for c, _ in rows]
            v, new_states, reused = cached_forward(self.module, x, t, cond, states, self.cache_threshold, requests,
                                                   last)
            for (c, b), state in zip(rows, new_states, strict=True):
                c.new_step_cache[b] = state
            self.cache_reused_rows += reused
            self.cache_computed_rows += len(rows) - reused
        if not isinstance(v, torch.Tensor) or v.shape != x.shape:
            shown = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"node '{self.node.name}': the module returned {shown} for latents {list(x.shape)}; "
                             "it must return one velocity per latent, shaped like x")
        return list(v.to(torch.float32).unbind(0))

    def _check_ports(self, allowed: tuple[str, ...]) -> None:
        extra = sorted(self.outputs - set(allowed))
        if extra:
            raise ModelLoadError(f"node '{self.node.name}' (engine 'diffusion', role {self.role!r}): unknown outputs "
                                 f"{extra}; a {self.role} node produces {', '.join(allowed)}")
        if "latents" not in self.outputs:
            raise ModelLoadError(f"node '{self.node.name}' (engine 'diffusion'): declare output 'latents'")
        inputs = set(self.node.all_inputs)
        if self.role == "step":
            missing = [n for n in ("latents", "step") if n not in inputs]
            if missing:
                raise ModelLoadError(f"node '{self.node.name}' (engine 'diffusion'): a step node needs inputs {missing} "
                                     "(map 'step' to the loop's index: NodeCall(node, inputs={'step': 'loop_index'}))")

    def _check_substitutes(self) -> None:
        for branch, mapping in self.uncond_inputs.items():
            for target, source in mapping.items():
                if target not in self.cond_inputs + self.optional_cond or source not in self.node.all_inputs:
                    option = "uncond_inputs" if branch == "uncond" else "uncond_image_inputs"
                    raise ModelLoadError(
                        f"node '{self.node.name}' (engine 'diffusion'): option {option} maps {target!r} -> {source!r}, "
                        f"but both must be node inputs, the first a conditioning input of the module "
                        f"({', '.join(self.cond_inputs + self.optional_cond) or 'none'})")


def _cache_threshold(node: Any, value: Any) -> float | None:
    """The step cache's threshold: None (off, the default) or a number >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ModelLoadError(f"node '{node.name}' (engine 'diffusion'): setting step_cache_threshold must be a number "
                             f">= 0 (the summed relative change of the first block's input below which every block "
                             f"is skipped), got {value!r}")
    return float(value)


def _call_bytes(call: _Call) -> int:
    """Bytes of the tensors a queued call holds: its latents, solver history, cached residuals, conditioning."""
    return _nbytes((call.latents, call.history, call.velocities, call.conds, call.step_cache))


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


def _to(value: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """On the device; floating-point conditioning in the module's dtype (integer labels stay integers)."""
    return value.to(device, dtype) if value.dtype.is_floating_point else value.to(device)


def _tensor(node: str, name: str, value: Any) -> torch.Tensor:
    """Conditioning as a tensor (ints and floats, e.g. class labels, become 0-d tensors)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return torch.tensor(value)
    raise RequestError(f"node '{node}': conditioning input '{name}' must be a tensor or a number, "
                       f"got {type(value).__name__}", param=name)
