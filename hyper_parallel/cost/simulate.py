"""Step-time simulation of a rank's compiled programs: compute and communication on two streams.

The forward then the backward GraphModule is walked in node order, as the runtime issues it:

- a compute node runs on the compute stream for its roofline time (``compute.roofline_time``);
- a collective is issued at its node (costing the compute stream one op overhead) and starts when
  the communication stream is free; its result is ready ``comm.collective_time`` later;
- ``wait_tensor`` blocks the compute stream until its collective is done; the blocked time is the
  *exposed* communication.

One communication stream, because NCCL / HCCL run the collectives of a process group in issue order
on one internal stream, and gloo on one background thread per group; with several groups (dp and
tp) real backends could overlap two collectives, so on multi-axis plans this is an upper bound on
communication time. Each program call starts with the runtime's host work (the profile's
``program_overhead_s`` plus ``boundary_overhead_s`` per forward input / backward gradient; zero on
accelerator profiles, where the host runs ahead). After backward, the optimizer step is
memory-bound: it reads and writes the parameters and optimizer state and reads the gradients once
(``optimizer_traffic``), plus ``optimizer_tensor_overhead_s`` per parameter tensor (torch's
per-parameter loop on CPU; foreach kernels on accelerators launch few).

The per-call agreement (``distributed.spmd.agree``, given ``agreement_ranks``) is issued as the
first forward program starts, on the host ("host" stream: it holds neither device stream), and
takes ``comm.agreement_time``; the program's gate node (``meta.AGREEMENT_GATE``, right before its
first collective) waits for it, or, without a gate, the program's end. What it waits is
``agreement_exposed_s``.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Mapping, Sequence

import torch

from ..compat import pytree
from ..ir.graph import module_fqn_of
from ..compat import op_overload_name
from .comm import AxisInfo, agreement_time, collective_time, group_name_of, group_size_of, unknown_axis
from ..ir.collectives import collective_kind
from .compute import node_work, roofline_time, tensor_bytes
from .hardware import HardwareProfile, get_profile
from ..ir import meta

__all__ = ["Event", "Timeline", "StepEstimate", "simulate", "simulate_program", "optimizer_time",
           "optimizer_traffic", "mfu"]


@dataclasses.dataclass(frozen=True)
class Event:
    """One interval on one stream. ``category``: "compute", "comm", "wait" or "agreement";
    ``stream``: "compute", "comm" or "host" (the per-call agreement); ``phase``: "forward",
    "backward" or "optimizer"."""

    name: str
    category: str
    stream: str
    start_s: float
    end_s: float
    node: str = ""
    module: str = ""
    op: str = ""
    flops: int = 0
    bytes: int = 0
    phase: str = ""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclasses.dataclass
class Timeline:
    """Events in issue order."""

    events: list[Event] = dataclasses.field(default_factory=list)

    def __iter__(self):
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)

    def of(self, category: str) -> list[Event]:
        return [e for e in self.events if e.category == category]


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """One rank's estimated training step. ``compute_s`` and ``comm_s`` are busy times of the two
    streams; ``exposed_comm_s`` is the time compute waited for communication; ``step_s`` is the end
    of the last event (forward + backward + optimizer). ``flops`` counts every FLOP this rank runs
    (hardware FLOPs); ``recompute_flops`` the part that recomputes forward values in backward
    (nodes the recompute pass made, ``meta["hp_recompute"]``), so ``flops - recompute_flops`` are
    the model FLOPs that MFU is conventionally computed from."""

    timeline: Timeline
    profile: str
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    step_s: float
    flops: int
    recompute_flops: int = 0
    agreement_s: float = 0.0  # the per-call agreement's exchange (0: one rank, or not asked for)
    agreement_exposed_s: float = 0.0  # the part of it the forward waited for at its gate

    @property
    def model_flops(self) -> int:
        """FLOPs of the step without recomputation (what MFU counts)."""
        return self.flops - self.recompute_flops

    def as_dict(self) -> dict:
        """The totals, JSON-friendly (the timeline is left out: see ``to_chrome_trace``)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "timeline"}
        out["num_events"] = len(self.timeline)
        return out

    def __str__(self) -> str:
        return (f"step {self.step_s * 1e3:.3f} ms on {self.profile}: compute {self.compute_s * 1e3:.3f} ms, "
                f"comm {self.comm_s * 1e3:.3f} ms ({self.exposed_comm_s * 1e3:.3f} ms exposed), optimizer "
                f"{self.optimizer_s * 1e3:.3f} ms, {self.flops / 1e9:.3f} GFLOP")


def _programs(programs) -> list[torch.fx.GraphModule]:
    if isinstance(programs, torch.fx.GraphModule):
        return [programs]
    if hasattr(programs, "forward_gm"):  # a runtime CompiledProgram
        return [programs.forward_gm, programs.backward_gm]
    return list(programs)


class _Simulator:
    def __init__(self, axes: Mapping[str, AxisInfo], profile: HardwareProfile, agreement_s: float = 0.0):
        self.axes, self.profile = axes, profile
        self.agreement_s = agreement_s
        self.agreement_ready: float | None = None  # when the exchange is done (None: not issued, or waited)
        self.agreement_exposed = 0.0
        self.events: list[Event] = []
        self.compute_t = 0.0  # when the compute stream is next free
        self.comm_t = 0.0  # when the communication stream is next free
        self.ready: dict[torch.fx.Node, float] = {}  # collective (or its getitem) -> result ready
        self.exposed = 0.0
        self.flops = 0
        self.recompute_flops = 0

    def _axis(self, node: torch.fx.Node) -> AxisInfo:
        group = group_name_of(node.args[-1])
        axis = self.axes.get(group)
        if axis is not None:
            return axis
        size = group_size_of(node)
        if size is None:
            raise ValueError(
                f"cost model: collective {node.name} ({op_overload_name(node.target)}) runs on process group "
                f"{group!r}, which is not in the axis table (known: {sorted(self.axes)}); pass "
                "axis_infos(mesh) or an AxisInfo for it"
            )
        return unknown_axis(group, size)

    def _emit(self, node, category, stream, start, end, phase, flops=0, nbytes=0, name=None) -> None:
        self.events.append(Event(
            name=name or op_overload_name(node.target), category=category, stream=stream, start_s=start, end_s=end,
            node=node.name, module=module_fqn_of(node), op=op_overload_name(node.target), flops=flops, bytes=nbytes,
            phase=phase,
        ))

    def run(self, gm: torch.fx.GraphModule, phase: str) -> None:
        if phase == "forward" and self.agreement_s > 0 and not self.events:  # the call's first program
            self.agreement_ready = self.compute_t + self.agreement_s
            self.events.append(Event("agreement", "agreement", "host", self.compute_t, self.agreement_ready,
                                     op="agreement", phase=phase))
        # The runtime's host work around the program: converting each boundary tensor (forward:
        # its inputs; backward: the gradients it returns) between DTensor and local, autograd.
        if phase == "forward":
            boundary = len(gm.graph.find_nodes(op="placeholder"))
        else:
            boundary = sum(isinstance(g, torch.fx.Node) for g in pytree.tree_leaves(gm.graph.output_node().args))
        host = self.profile.program_overhead_s + boundary * self.profile.boundary_overhead_s
        if host > 0:
            self.events.append(Event(f"{phase} runtime", "compute", "compute", self.compute_t, self.compute_t + host,
                                     op="runtime", phase=phase))
            self.compute_t += host
        for node in gm.graph.nodes:
            work = node_work(node)
            if node.meta.get(meta.AGREEMENT_GATE):
                self._await_agreement(node, phase)
                continue
            if work.kind == "none":
                continue
            if work.kind == "comm":
                self._collective(node, work.bytes, phase)
            elif work.kind == "wait":
                self._wait(node, phase)
            else:
                if node.target is operator.getitem and node.args[0] in self.ready:
                    self.ready[node] = self.ready[node.args[0]]  # a coalesced collective's piece
                duration = roofline_time(work, self.profile)
                if duration > 0:  # views are free on accelerators (the host runs ahead): no event
                    self._emit(node, "compute", "compute", self.compute_t, self.compute_t + duration, phase,
                               work.flops, work.bytes)
                self.compute_t += duration
                self.flops += work.flops
                if node.meta.get(meta.RECOMPUTE) is not None:
                    self.recompute_flops += work.flops
        if self.agreement_ready is not None:  # no gate: the runtime waits as the forward returns
            self._await_agreement(gm.graph.output_node(), phase)
        # A program returns only once every collective it issued is done (the runtime waits on
        # them all): a collective never waited on is exposed here.
        pending = max((t for n, t in self.ready.items() if n.graph is gm.graph), default=0.0)
        if pending > self.compute_t:
            self._emit(gm.graph.output_node(), "wait", "compute", self.compute_t, pending, phase, name="wait (end)")
            self.exposed += pending - self.compute_t
            self.compute_t = pending

    def _collective(self, node: torch.fx.Node, nbytes: int, phase: str) -> None:
        axis = self._axis(node)
        kind = collective_kind(node)
        # Issuing costs the compute stream a launch; the transfer then waits for the comm stream.
        issue = self.profile.op_overhead_s
        if issue > 0:
            self._emit(node, "compute", "compute", self.compute_t, self.compute_t + issue, phase, name=f"issue {kind}")
            self.compute_t += issue
        start = max(self.compute_t, self.comm_t)
        end = start + collective_time(kind, nbytes, axis, self.profile)
        self.comm_t = self.ready[node] = end
        self._emit(node, "comm", "comm", start, end, phase, nbytes=nbytes, name=f"{kind}[{axis.name}]")

    def _await_agreement(self, node: torch.fx.Node, phase: str) -> None:
        ready, self.agreement_ready = self.agreement_ready, None
        if ready is not None and ready > self.compute_t:
            self._emit(node, "wait", "compute", self.compute_t, ready, phase, name="wait (agreement)")
            self.agreement_exposed += ready - self.compute_t
            self.compute_t = ready

    def _wait(self, node: torch.fx.Node, phase: str) -> None:
        ready = self.ready.get(node.args[0])
        if ready is not None and ready > self.compute_t:
            self._emit(node, "wait", "compute", self.compute_t, ready, phase, name="wait")
            self.exposed += ready - self.compute_t
            self.compute_t = ready


def optimizer_traffic(backward_gm: torch.fx.GraphModule, state_per_param: int = 0) -> tuple[int, int]:
    """(bytes, tensors) one optimizer step moves, from the gradients ``backward_gm`` returns: each
    gradient is read once, its parameter (same size) read and written, and ``state_per_param``
    parameter-sized state tensors read and written (SGD 0, momentum 1, Adam/AdamW 2)."""
    grads = [g for g in backward_gm.graph.output_node().args[0] if isinstance(g, torch.fx.Node)]
    sizes = [tensor_bytes(g.meta.get("val")) for g in grads]
    return sum(sizes) * (1 + 2 + 2 * state_per_param), len(sizes)


def simulate(
    programs: Sequence[torch.fx.GraphModule] | torch.fx.GraphModule,
    axes: Mapping[str, AxisInfo],
    profile: HardwareProfile | str,
    optimizer_bytes: int = 0,
    optimizer_tensors: int = 0,
    agreement_ranks: int = 1,
) -> StepEstimate:
    """Estimate one training step of ``programs`` (``(forward_gm, backward_gm)`` as
    ``ParallelModule.compiled_programs()`` returns them, a ``CompiledProgram``, or any sequence of
    GraphModules run one after another) on ``profile``. ``axes``: ``{process-group name: AxisInfo}``
    (``comm.axis_infos(mesh)``); a group missing from it is treated as inter-node when the
    collective states its size, else it is an error. ``optimizer_bytes`` / ``optimizer_tensors``:
    the optimizer step's memory traffic and tensor count (``optimizer_traffic``); 0 = no step.
    ``agreement_ranks``: the ranks the per-call agreement spans (the world; 1: none priced)."""
    profile = get_profile(profile)
    gms = _programs(programs)
    return _simulate(gms, ["forward"] + ["backward"] * (len(gms) - 1), axes, profile, optimizer_bytes,
                     optimizer_tensors, agreement_time(agreement_ranks, profile))


def simulate_program(gm: torch.fx.GraphModule, phase: str, axes: Mapping[str, AxisInfo],
                     profile: HardwareProfile | str, agreement_ranks: int = 1) -> StepEstimate:
    """One program alone, as ``phase`` ("forward" or "backward": which boundary tensors the
    runtime's host work converts): a pipeline stage's forward, backward, or split backward step.
    ``agreement_ranks``: as :func:`simulate` (a forward that starts a step waits at its gate)."""
    if phase not in ("forward", "backward"):
        raise ValueError(f"simulate_program: phase is 'forward' or 'backward', got {phase!r}")
    profile = get_profile(profile)
    return _simulate([gm], [phase], axes, profile, 0, 0, agreement_time(agreement_ranks, profile))


def optimizer_time(optimizer_bytes: int, optimizer_tensors: int, profile: HardwareProfile | str) -> float:
    """Seconds of an optimizer step moving ``optimizer_bytes`` over ``optimizer_tensors`` parameter
    tensors (``optimizer_traffic``): memory-bound, plus a launch per tensor."""
    profile = get_profile(profile)
    if not (optimizer_bytes or optimizer_tensors):
        return 0.0
    per_tensor = profile.optimizer_tensor_overhead_s
    per_tensor = profile.op_overhead_s if per_tensor is None else per_tensor
    return optimizer_bytes / (profile.hbm_bandwidth * profile.memory_efficiency) + optimizer_tensors * per_tensor


def _simulate(gms, phases, axes, profile: HardwareProfile, optimizer_bytes: int, optimizer_tensors: int,
              agreement_s: float = 0.0) -> StepEstimate:
    sim = _Simulator(axes, profile, agreement_s)
    phase_ends = []
    for gm, phase in zip(gms, phases):
        sim.run(gm, phase)
        phase_ends.append(sim.compute_t)
    optimizer_s = 0.0
    if optimizer_bytes or optimizer_tensors:
        optimizer_s = optimizer_time(optimizer_bytes, optimizer_tensors, profile)
        sim.events.append(Event("optimizer.step", "compute", "compute", sim.compute_t, sim.compute_t + optimizer_s,
                                op="optimizer.step", bytes=optimizer_bytes, phase="optimizer"))
        sim.compute_t += optimizer_s
    events = sim.events
    compute_s = sum(e.duration_s for e in events if e.category == "compute")
    if phases[:1] == ["forward"]:
        forward_s = phase_ends[0] if phase_ends else 0.0
        backward_s = (phase_ends[-1] - forward_s) if len(phase_ends) > 1 else 0.0
    else:  # a backward program alone
        forward_s, backward_s = 0.0, phase_ends[-1] if phase_ends else 0.0
    return StepEstimate(
        timeline=Timeline(events), profile=profile.name, compute_s=compute_s,
        comm_s=sum(e.duration_s for e in events if e.category == "comm"), exposed_comm_s=sim.exposed,
        forward_s=forward_s, backward_s=backward_s, optimizer_s=optimizer_s, step_s=sim.compute_t, flops=sim.flops,
        recompute_flops=sim.recompute_flops, agreement_s=agreement_s, agreement_exposed_s=sim.agreement_exposed,
    )


def mfu(flops_per_step: float, step_s: float, profile: HardwareProfile | str,
        dtype: str | torch.dtype = "bf16") -> float:
    """FLOP utilisation: ``flops_per_step`` per second over the profile's dense peak for ``dtype``.
    Pass the model FLOPs (``StepEstimate.model_flops``) for MFU, all FLOPs for hardware FLOPs
    utilisation (HFU)."""
    if step_s <= 0:
        raise ValueError(f"mfu: step time must be positive, got {step_s}")
    return flops_per_step / step_s / get_profile(profile).flops_per_s(dtype)
