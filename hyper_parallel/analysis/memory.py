"""Memory estimator: one rank's peak memory over a training step, from liveness in the final programs.

An analysis, not a pass: it reads a :class:`~hyper_parallel.runtime.program.CompiledProgram` (the
forward and backward GraphModules after every pass and the partition, with each node's local
``meta["val"]``) and writes nothing. ``ParallelModule.memory_report()`` and the compile summary's
``"memory"`` entry call :func:`estimate`.

How it counts. The forward graph, then the backward graph, is replayed node by node on meta
tensors (no memory, no communication) so that every value has exact strides and, above all, a
*storage*: views, ``_unsafe_view``, ``reshape`` when the strides allow a view, ``split`` pieces,
in-place results and ``wait_tensor`` (which returns its collective's buffer) share their base's
storage, and a storage is counted once, from the node that allocates it until the last value
holding it dies. A value dies after its last use in its graph (fx's generated code drops it there),
except what the runtime (``runtime/program.py``) keeps:

- forward placeholders (parameter shards, buffers, the user's batch) are held by the caller;
- the forward's saved tensors are held by the autograd context until backward starts, then by the
  backward program: to their last use there if it takes its arguments boxed (one list it clears,
  ``compat.is_boxed_call``), else until it returns;
- the forward's user outputs live to the end of forward, or with ``keep_outputs=True`` to the end of
  backward (``out = model(...); out.loss.backward()`` keeps the logits alive);
- tangents live for the whole backward; backward's outputs are the gradients: they become ``.grad``
  and stay. Gradients are assumed absent before forward (``zero_grad(set_to_none=True)``).

Peak = the largest of: parameters + buffers + inputs + optimizer state + live values, at every node
of forward and backward; and the optimizer step (the same plus all gradients plus the step's
temporaries, see :class:`OptimizerModel`). Only storages on one device are counted (the first
accelerator the program uses, else the CPU), so host copies (CPU offload) do not count against an
accelerator.

Not modelled in the peak: memory an op allocates and frees internally (kernel workspaces),
allocator caching and fragmentation (``torch.cuda.memory_reserved`` minus allocated; the separate
``reserved_*`` fields replay the step through a model of the caching allocator,
``analysis/allocator_model.py``), buffers the communication
backend allocates outside torch's allocator, the Python-side references a caller keeps beyond
the ones listed above, and inputs that share a storage (``labels`` the very tensor ``input_ids``
is: each forward input is counted as its own storage).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch

from .allocator_model import CachingAllocatorModel
from ..ir.kinds import InputKind
from ..ir.ops import aliases_input
from ..runtime.zero_tangents import zero_add_operand
from ..compat import pytree
from .. import compat

__all__ = [
    "MemoryEstimate", "OptimizerModel", "PeakSite", "estimate", "estimate_program", "format_bytes", "optimizer_model",
]

# Collectives whose output is a fresh communication buffer.
_COMM_TARGETS = frozenset(
    getattr(torch.ops._c10d_functional, name).default
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single",
                 "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "all_reduce_coalesced")
    if hasattr(torch.ops._c10d_functional, name)
)
# Returns its argument at run time (the collective's buffer), although the schema says it allocates.
_RETURNS_ARG0 = frozenset({torch.ops._c10d_functional.wait_tensor.default})
# Schema says it allocates, but the kernel returns a view of the input.

# Categories of live memory, in report order. A storage held by several values gets the first of
# their categories in this order (a saved view of a gathered buffer counts as saved).
CATEGORIES = (
    "params", "buffers", "inputs", "optimizer_state", "grads", "saved_activations", "comm_buffers",
    "temporaries",
)
_RANK = {c: i for i, c in enumerate(CATEGORIES)}


@dataclasses.dataclass(frozen=True)
class PeakSite:
    """Where a peak is reached: the node that had just allocated when live memory was highest."""

    phase: str  # "forward" | "backward" | "optimizer"
    node: str  # node name in its program ("" at a phase boundary and for the optimizer step)
    module: str  # FQN of the module the node came from ("" = root)
    source: str  # the user's source line (``File "...", line N, in f: code``), or ""

    def __str__(self) -> str:
        where = f"{self.phase} {self.node}" if self.node else self.phase
        if self.module:
            where += f" in {self.module}"
        return where + (f" ({self.source})" if self.source else "")


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one rank for one training step (forward, backward, optimizer step)."""

    device: str
    params: int
    buffers: int
    inputs: int  # the user's batch and whatever else the caller passes (pending gradients, ...)
    grads: int  # all gradients once backward has produced them
    optimizer_state: int
    saved_activations: int  # storages forward allocates and backward reads (parameters excluded)
    comm_buffers_max: int  # most collective-output bytes live at once
    peak_forward: int
    peak_backward: int
    peak_optimizer: int  # persistent + all gradients + optimizer state + the step's temporaries
    peak: int
    peak_site: PeakSite
    at_peak: dict  # category -> bytes live at the peak (sums to ``peak``)
    optimizer: str  # the optimizer model assumed
    # What the CUDA caching allocator would reserve (``max_memory_reserved``) for this step repeated
    # (analysis/allocator_model.py): with its default settings and with ``expandable_segments:True``.
    reserved_default: int = 0
    reserved_expandable: int = 0

    def as_dict(self) -> dict:
        """JSON-friendly: the numbers, the peak site (fields and ``where``), the breakdown."""
        out = dataclasses.asdict(self)
        out["peak_site"] = {**dataclasses.asdict(self.peak_site), "where": str(self.peak_site)}
        return out

    def __str__(self) -> str:
        lines = [f"peak {format_bytes(self.peak)} on {self.device} at {self.peak_site}"]
        lines += [f"  {k:<18} {format_bytes(v)}" for k, v in self.at_peak.items() if v]
        lines.append(
            f"  forward peak {format_bytes(self.peak_forward)}, backward peak "
            f"{format_bytes(self.peak_backward)}, optimizer step {format_bytes(self.peak_optimizer)} "
            f"(optimizer: {self.optimizer})"
        )
        if self.device != "cpu":  # the CPU allocator caches nothing
            lines.append(
                f"  reserved by the CUDA caching allocator: {format_bytes(self.reserved_expandable)} with "
                f"expandable segments, {format_bytes(self.reserved_default)} with its defaults"
            )
        return "\n".join(lines)


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


# --- optimizer ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OptimizerModel:
    """What an optimizer adds: ``state`` parameter-sized tensors per trainable parameter, and while
    ``step()`` runs, temporaries: ``foreach_temporaries`` times all trainable parameters with the
    foreach implementation (torch's default on accelerators), ``per_tensor_temporaries`` times the
    largest parameter with the per-parameter loop (torch's default on CPU). ``foreach=None``: as
    torch decides for the device."""

    name: str
    state: int = 0
    foreach_temporaries: int = 0
    per_tensor_temporaries: int = 0
    foreach: bool | None = None


# Adam's foreach step computes sqrt(exp_avg_sq) for every parameter and works in place from there;
# its per-parameter loop holds sqrt(exp_avg_sq), its quotient ``denom`` and the previous
# parameter's ``denom`` (still bound to the loop variable) at once. L2 weight decay (Adam, SGD)
# and Nesterov make a new gradient-sized tensor.
_NAMED = {
    "none": OptimizerModel("none"),
    "sgd": OptimizerModel("sgd"),
    "sgd_momentum": OptimizerModel("sgd_momentum", state=1),
    "adam": OptimizerModel("adam", state=2, foreach_temporaries=1, per_tensor_temporaries=3),
    "adamw": OptimizerModel("adamw", state=2, foreach_temporaries=1, per_tensor_temporaries=3),
}


def optimizer_model(optimizer: Any) -> OptimizerModel:
    """The :class:`OptimizerModel` of an optimizer instance or class (SGD, Adam, AdamW), a name in
    ``("none", "sgd", "sgd_momentum", "adam", "adamw")``, an ``OptimizerModel``, or None (no optimizer)."""
    if optimizer is None:
        return _NAMED["none"]
    if isinstance(optimizer, OptimizerModel):
        return optimizer
    if isinstance(optimizer, str):
        if optimizer.lower() not in _NAMED:
            raise ValueError(
                f"memory estimate: unknown optimizer {optimizer!r}; pass one of {sorted(_NAMED)}, a "
                "torch.optim.SGD/Adam/AdamW instance or a hyper_parallel.analysis.memory.OptimizerModel"
            )
        return _NAMED[optimizer.lower()]
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    groups = [{}] if isinstance(optimizer, type) else optimizer.param_groups
    flag = lambda key: any(bool(g.get(key)) for g in groups)  # noqa: E731
    foreach = True if flag("foreach") or flag("fused") else (False if any(g.get("foreach") is False for g in groups) else None)
    if issubclass(cls, torch.optim.SGD):
        extra = int(flag("weight_decay")) + int(flag("nesterov"))
        state = int(flag("momentum"))
        return OptimizerModel("sgd_momentum" if state else "sgd", state, extra, extra, foreach)
    if issubclass(cls, (torch.optim.Adam, torch.optim.AdamW)):
        name = "adamw" if issubclass(cls, torch.optim.AdamW) else "adam"
        l2 = int(name == "adam" and flag("weight_decay"))
        amsgrad = flag("amsgrad")
        return OptimizerModel(name + ("+amsgrad" if amsgrad else ""), 3 if amsgrad else 2, 1 + l2, 3 + l2, foreach)
    raise ValueError(
        f"memory estimate: no model for {cls.__name__}; pass optimizer='sgd' / 'sgd_momentum' / 'adam' / "
        "'adamw' (the closest match) or a hyper_parallel.analysis.memory.OptimizerModel"
    )


def _real_state_bytes(optimizer, device: str) -> int | None:
    """Bytes of the tensor state an optimizer holds now on ``device`` (local shards of DTensor
    state, step counters included), or None before its first step."""
    if not isinstance(optimizer, torch.optim.Optimizer) or not optimizer.state:
        return None
    storages = {}
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = compat.plain_tensor(value)
                if local.device.type == device:
                    storages[compat.storage_key(local)] = local.untyped_storage().nbytes()
    return sum(storages.values())


# --- replay on meta tensors: exact strides and storage identity ----------------------------------


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


class _MetaRunner:
    """Replays graph nodes on meta tensors. Ops that may return a view of an input (schema alias
    annotations: views, in-place ops, ``reshape``, a view only when the strides allow) really run,
    so their result shares its input's storage exactly when the real op's would; every other op
    gets a fresh storage shaped like its recorded ``val``. Meta tensors have no device, so each
    storage's device is kept aside."""

    def __init__(self):
        self.devices: dict = {}  # storage key -> device type

    def fresh(self, val):
        def make(v):
            if isinstance(v, torch.SymInt):  # a data-dependent size: its hint (compat.size_hint)
                return compat.size_hint(v)
            if not isinstance(v, torch.Tensor):
                return v
            shape, stride = [compat.size_hint(s) for s in v.shape], [compat.size_hint(s) for s in v.stride()]
            t = torch.empty_strided(shape, stride, dtype=v.dtype, device="meta")
            self.devices[compat.storage_key(t)] = v.device.type
            return t

        return pytree.tree_map(make, val)

    def run(self, node: torch.fx.Node, env: dict, gm: torch.fx.GraphModule):
        args, kwargs = pytree.tree_map_only(torch.fx.Node, lambda n: env[n], (node.args, node.kwargs))
        if node.op == "get_attr":
            return self.fresh(operator.attrgetter(node.target)(gm))
        if node.target is operator.getitem:
            return args[0][args[1]]
        if node.target in _RETURNS_ARG0:
            return args[0]
        if aliases_input(node.target):
            try:
                return node.target(*args, **kwargs)
            except Exception:  # no meta kernel: alias the first tensor argument, as recorded
                first = next(iter(_tensors(args)), None)
                if first is not None:
                    return pytree.tree_map_only(
                        torch.Tensor, lambda v: first.as_strided(v.shape, v.stride(), first.storage_offset()),
                        node.meta.get("val"),
                    )
        return self.fresh(node.meta.get("val"))


# --- liveness --------------------------------------------------------------------------------------

_FOREVER = float("inf")


@dataclasses.dataclass
class _Storage:
    nbytes: int
    device: str
    category: str
    born: int
    dies: float


class _Timeline:
    """Storages with the first and last moment they are live; moments are the nodes of forward
    then backward, plus one moment at each phase's start and end."""

    def __init__(self, devices: dict):
        self.devices = devices
        self.storages: dict[Any, _Storage] = {}
        self.moments: list[tuple[str, torch.fx.Node | None]] = []

    def moment(self, phase: str, node: torch.fx.Node | None = None) -> int:
        self.moments.append((phase, node))
        return len(self.moments) - 1

    def hold(self, value, born: int, until: float, category: str) -> None:
        """Every storage behind ``value`` is live from ``born`` (allocated then if new) to ``until``."""
        for tensor in _tensors(value):
            key = compat.storage_key(tensor)
            storage = self.storages.get(key)
            if storage is None:
                nbytes = tensor.untyped_storage().nbytes()
                storage = self.storages[key] = _Storage(nbytes, self.devices.get(key, "cpu"), category, born, until)
            storage.dies = max(storage.dies, until)
            if _RANK[category] < _RANK[storage.category]:
                storage.category = category


def _replay(graph_module, env: dict, runner: _MetaRunner, timeline: _Timeline, phase: str,
            aliases: dict | None = None) -> dict:
    """Run the graph's non-placeholder nodes into ``env``; returns node -> moment. ``aliases``:
    nodes that are another node's value (node -> that node), allocating nothing."""
    times = {}
    for node in graph_module.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        env[node] = env[aliases[node]] if aliases and node in aliases else runner.run(node, env, graph_module)
        times[node] = timeline.moment(phase, node)
    return times


def _last_use(node: torch.fx.Node, times: dict) -> int:
    """The moment fx's generated code drops ``node``: after its last user, or at once if unused."""
    return max((times[u] for u in node.users if u.op != "output"), default=times[node])


def estimate(
    program,
    input_kinds: list[str] | None = None,
    optimizer: Any = None,
    keep_outputs: bool = True,
    device: str | None = None,
    series: list | None = None,
) -> MemoryEstimate:
    """Estimate one rank's peak memory for one training step of ``program`` (a ``CompiledProgram``).

    ``input_kinds``: per forward placeholder, ``"param"``, ``"buffer"``, ``"input"`` or another kind
    (counted as an input); default: every placeholder is a parameter. ``optimizer``: see
    :func:`optimizer_model`; an optimizer instance that has stepped contributes its real state
    bytes. ``keep_outputs``: the caller holds the user outputs (e.g. logits) until backward ends.
    ``device``: the device type counted (default: the first non-CPU device in the program, else CPU).
    ``series``: a list to append, for each moment (each node of forward then backward, and each
    phase's start and end) and then for the optimizer step, the point ``{"phase", "node",
    "module", "bytes", "live"}`` (``live``: bytes per category in :data:`CATEGORIES` order); its
    largest ``bytes`` is the estimate's ``peak``.
    """
    fwd, bwd = program.forward_gm, program.backward_gm
    runner = _MetaRunner()
    timeline = _Timeline(runner.devices)

    # Forward. Placeholders are the caller's: live all step long.
    placeholders = list(fwd.graph.find_nodes(op="placeholder"))
    kinds = list(input_kinds) if input_kinds is not None else ["param"] * len(placeholders)
    if len(kinds) != len(placeholders):
        raise ValueError(f"memory estimate: {len(kinds)} input kinds for {len(placeholders)} forward inputs")
    env: dict = {}
    start = timeline.moment("forward")
    for node, kind in zip(placeholders, kinds):
        env[node] = runner.fresh(node.meta.get("val"))
        timeline.hold(env[node], start, _FOREVER, {"param": "params", "buffer": "buffers"}.get(kind, "inputs"))
    times = _replay(fwd, env, runner, timeline, "forward")
    fwd_end = timeline.moment("forward")
    outputs = list(fwd.graph.output_node().args[0])
    user_outputs = {o for o in outputs[: program.num_user_outputs] if isinstance(o, torch.fx.Node)}
    saved = outputs[program.num_user_outputs :]

    # Backward. Its first placeholders are the saved tensors (the forward's very values), the
    # rest the tangents.
    bplaceholders = list(bwd.graph.find_nodes(op="placeholder"))
    benv: dict = {}
    bwd_start = timeline.moment("backward")
    # The backward as the runtime runs it when only some outputs get a gradient (the loss, not the
    # logits: runtime/zero_tangents.py), without building that program: an absent tangent holds no
    # memory and an add of it is its other operand (a tangent read otherwise is zeros made for it).
    missing = program.missing_tangents() if hasattr(program, "missing_tangents") else ()
    absent = {bplaceholders[len(saved) + j] for j in missing}
    aliases = {user: other for tangent in absent for user in tangent.users
               if (other := zero_add_operand(user, tangent)) is not None}
    for i, node in enumerate(bplaceholders):
        if node not in absent or any(u not in aliases for u in node.users):
            benv[node] = env[saved[i]] if i < len(saved) else runner.fresh(node.meta.get("val"))
    btimes = {node: bwd_start for node in bplaceholders}
    btimes.update(_replay(bwd, benv, runner, timeline, "backward", aliases))
    bwd_end = timeline.moment("backward")
    grads = list(bwd.graph.output_node().args[0])

    # Lifetimes, in graph order so a storage's category comes from the node that allocates it.
    # Saved tensors: the autograd context holds them until backward starts; then the backward
    # program holds them to its last use if it frees its arguments (boxed calling convention),
    # else until it returns.
    boxed = compat.is_boxed_call(bwd)
    saved_set = {s for s in saved if isinstance(s, torch.fx.Node)}
    for node, t in times.items():
        if node.op == "get_attr":  # the module's constants: live all along
            timeline.hold(env[node], start, _FOREVER, "buffers")
            continue
        until, category = _last_use(node, times), _kind(node)
        if node in saved_set:
            until, category = bwd_start if boxed else bwd_end, "saved_activations"
        if node in user_outputs:
            until = max(until, bwd_end if keep_outputs else fwd_end)
        timeline.hold(env[node], t, until, category)
    for i, node in enumerate(bplaceholders):
        if i < len(saved):
            until = _last_use(node, btimes) if boxed else bwd_end
            timeline.hold(benv[node], bwd_start, until, "saved_activations")
        elif node in absent and node in benv:  # zeros the program makes: live to their last use
            timeline.hold(benv[node], bwd_start, _last_use(node, btimes), "temporaries")
        elif node in benv:  # tangents: autograd's grad_outputs hold them until backward returns
            timeline.hold(benv[node], bwd_start, bwd_end, "temporaries")
    grad_nodes = {g for g in grads if isinstance(g, torch.fx.Node)}
    for node, t in btimes.items():
        if node.op == "placeholder":
            continue
        if node in grad_nodes:
            timeline.hold(benv[node], t, _FOREVER, "grads")
        else:
            timeline.hold(benv[node], t, _last_use(node, btimes), "buffers" if node.op == "get_attr" else _kind(node))

    if device is None:
        device = next((s.device for s in timeline.storages.values() if s.device != "cpu"), "cpu")
    storages = [s for s in timeline.storages.values() if s.device == device]

    # Optimizer: state for every parameter that gets a gradient.
    model = optimizer_model(optimizer)
    trainable = [
        sum(t.untyped_storage().nbytes() for t in _tensors(env[node]))
        for i, (node, kind) in enumerate(zip(placeholders, kinds))
        if kind == "param" and i < len(grads) and grads[i] is not None
        and all(runner.devices.get(compat.storage_key(t)) == device for t in _tensors(env[node]))
    ]
    state = _real_state_bytes(optimizer, device)
    state = sum(trainable) * model.state if state is None else state
    foreach = model.foreach if model.foreach is not None else device != "cpu"
    if foreach:
        step_temps = model.foreach_temporaries * sum(trainable)
    else:
        step_temps = model.per_tensor_temporaries * max(trainable, default=0)

    result = _sweep(timeline, storages, start, state, step_temps, model.name, device, series)
    # The allocator's view, for a CUDA (or Ascend: the same caching rules) device even where this
    # estimate counts CPU storages (explain compiles on CPU for the hardware it prices).
    states = [size for size in trainable for _ in range(model.state)]
    temps = ([size for size in trainable for _ in range(model.foreach_temporaries)] if foreach
             else [max(trainable, default=0)] * model.per_tensor_temporaries)
    trace = allocation_trace(storages, start, len(timeline.moments), states, temps)
    return dataclasses.replace(result, reserved_default=CachingAllocatorModel(False).replay(trace).peak_reserved,
                               reserved_expandable=CachingAllocatorModel(True).replay(trace).peak_reserved)


def allocation_trace(storages, start: int, num_moments: int, optimizer_states: list[int], step_temporaries: list[int],
                     steps: int = 3) -> list[tuple]:
    """The step's allocations and frees in program order, ``steps`` times over, as
    :class:`~hyper_parallel.analysis.allocator_model.CachingAllocatorModel` replays them: what the caller
    holds all along (parameters, buffers, the batch) first; each step the program's storages at
    the moment they are born and after the last moment they are live (a moment's allocations come
    before its frees, as in the generated code); then the optimizer step, whose state
    (``optimizer_states``: bytes per tensor, made at the first step while the gradients are live,
    as torch.optim does) stays, whose temporaries (``step_temporaries``) are made together and freed
    together (a foreach step's lists), and after which the gradients are set to None."""
    born: dict[int, list] = {}
    dies: dict[int, list] = {}
    held, grads, trace = [], [], []
    for i, s in enumerate(storages):
        if s.born <= start and s.dies == _FOREVER:
            held.append((i, s.nbytes))
            continue
        born.setdefault(s.born, []).append(i)
        if s.dies == _FOREVER:
            grads.append(i)
        else:
            dies.setdefault(int(s.dies), []).append(i)
    trace += [("malloc", ("held", i), n) for i, n in held]
    for step in range(steps):
        for t in range(num_moments):
            trace += [("free", (step, i)) for i in dies.get(t - 1, ())]
            trace += [("malloc", (step, i), storages[i].nbytes) for i in born.get(t, ())]
        trace += [("free", (step, i)) for i in dies.get(num_moments - 1, ())]
        if step == 0:
            trace += [("malloc", ("state", j), n) for j, n in enumerate(optimizer_states)]
        trace += [("malloc", (step, "temp", j), n) for j, n in enumerate(step_temporaries)]
        trace += [("free", (step, "temp", j)) for j in range(len(step_temporaries))]
        trace += [("free", (step, i)) for i in grads]
    return trace


def estimate_program(program, captured, optimizer: Any = None, keep_outputs: bool = True,
                     series: list | None = None) -> MemoryEstimate:
    """:func:`estimate` for a compiled program, its forward inputs' kinds read from the capture
    (``captured.inputs``: parameters, buffers, user inputs, tangents). ``series``: as for
    :func:`estimate`, a list that receives the live bytes of every moment (for plots)."""
    kinds = [info.kind for info in captured.inputs if info.kind != InputKind.TANGENT]
    return estimate(program, kinds, optimizer=optimizer, keep_outputs=keep_outputs, series=series)


def _kind(node: torch.fx.Node) -> str:
    return "comm_buffers" if node.target in _COMM_TARGETS else "temporaries"


def _sweep(timeline: _Timeline, storages, start: int, state: int, step_temps: int, optimizer: str,
           device: str, series: list | None = None) -> MemoryEstimate:
    """Live bytes at every moment (a moment's allocations count before its frees), the peak and
    what is live there; with ``series``, appends each moment's point to it (see :func:`estimate`)."""
    num = len(timeline.moments)
    persistent = dict.fromkeys(CATEGORIES, 0)
    persistent["optimizer_state"] = state
    delta = {c: [0] * (num + 1) for c in CATEGORIES}
    for s in storages:
        if s.born <= start and s.dies == _FOREVER:
            persistent[s.category] += s.nbytes
            continue
        dies = num - 1 if s.dies == _FOREVER else int(s.dies)
        delta[s.category][s.born] += s.nbytes
        delta[s.category][dies + 1] -= s.nbytes
    live = dict(persistent)
    total = sum(live.values())
    best, best_at, best_live = -1, 0, dict(live)
    peaks = {"forward": 0, "backward": 0}
    comm_max = 0
    for t in range(num):
        for c in CATEGORIES:
            if delta[c][t]:
                live[c] += delta[c][t]
                total += delta[c][t]
        phase = timeline.moments[t][0]
        peaks[phase] = max(peaks[phase], total)
        comm_max = max(comm_max, live["comm_buffers"])
        if total > best:
            best, best_at, best_live = total, t, dict(live)
        if series is not None:
            series.append(_point(*timeline.moments[t], total, live))

    grads = sum(s.nbytes for s in storages if s.category == "grads")
    peak_optimizer = sum(persistent.values()) + grads + step_temps
    site = _site(*timeline.moments[best_at])
    if peak_optimizer > best:
        best, site = peak_optimizer, PeakSite("optimizer", "", "", "")
        best_live = dict(persistent, grads=grads, temporaries=step_temps)
    if series is not None:
        series.append(_point("optimizer", None, peak_optimizer, dict(persistent, grads=grads, temporaries=step_temps)))
    saved = sum(s.nbytes for s in storages if s.category == "saved_activations")
    return MemoryEstimate(
        device=device, params=persistent["params"], buffers=persistent["buffers"], inputs=persistent["inputs"],
        grads=grads, optimizer_state=state, saved_activations=saved, comm_buffers_max=comm_max,
        peak_forward=peaks["forward"], peak_backward=peaks["backward"], peak_optimizer=peak_optimizer,
        peak=best, peak_site=site, at_peak=best_live, optimizer=optimizer,
    )


def _point(phase: str, node: torch.fx.Node | None, total: int, live: dict) -> dict:
    from ..ir.graph import module_fqn_of

    return {"phase": phase, "node": node.name if node is not None else "",
            "module": module_fqn_of(node) if node is not None else "", "bytes": total,
            "live": [live[c] for c in CATEGORIES]}


def _site(phase: str, node: torch.fx.Node | None) -> PeakSite:
    if node is None:
        return PeakSite(phase, "", "", "")
    from ..ir.graph import module_fqn_of, source_line

    return PeakSite(phase, node.name, module_fqn_of(node), source_line(node))
