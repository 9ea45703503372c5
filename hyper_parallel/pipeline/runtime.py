"""The pipeline executor: runs this rank's stage programs over micro-batches, step by step of a schedule.

Each stage is a pair of GraphModules (forward, backward) cut from one joint graph
(passes/pipeline_split.py) and partitioned like any compiled program. The executor walks this
rank's list of :class:`~hyper_parallel.pipeline.schedules.MetaStep`:

* ``FWD_RECV`` / ``BWD_RECV`` post the receives of every value the stage reads from other ranks for
  that micro-batch (``torch.distributed`` ``irecv`` into buffers of the recorded shape and dtype);
* ``FORWARD`` waits for them, runs the forward program and keeps its saved tensors per micro-batch;
  ``BACKWARD`` runs the backward program on them plus the received gradients, adds the parameter
  gradients into a per-step accumulator and frees the saved tensors. Gradients are reduced once per
  step (passes/pipeline_split.py): a stage's micro-batches run its no-sync programs, whose backward
  returns local unreduced gradients (summed here, per parameter), except the micro-batch of the
  stage's last backward in the schedule, which runs the sync programs: their backward takes those
  sums as ``grad_accum`` inputs and reduces everything once with the fused collectives;
* ``FWD_SEND`` / ``BWD_SEND`` post ``isend`` of the values other stages read, batched per step.

Values between two stages on the same rank (interleaved schedules with one pp rank) are handed
over in memory. Messages carry a tag derived from (value, micro-batch), so a backend that matches
by tag (gloo) pairs them exactly; NCCL / HCCL match by order, which the built schedules keep
(every rank posts a pair's receives in the order the peer sends them).

The loss is the mean over all the step's tokens when the last stage returns its token count
(pipeline/loss.py: each micro-batch backward starts from its count, the gradients are divided by
the step's total afterwards); else the mean of the micro-batch losses (each backward starts from
1/M). It is broadcast from the last stage so every pp rank returns it. Each rank's measured compute
intervals are kept for the bubble report.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..ir.kinds import InputKind, OutputKind
from ..errors import internal_error
from ..passes.pipeline_split import LOSS_COUNT, RECV_BWD, RECV_FWD, SEND_BWD, SEND_FWD, StageGraph, Transfer
from ..ir.phase import BACKWARD, FORWARD
from .loss import summed_loss
from .schedules import MetaStep, MetaStepType

T = MetaStepType
GRAD_ACCUM = InputKind.GRAD_ACCUM


def flat_steps(schedule: list[MetaStep]) -> list[MetaStep]:
    """The schedule's steps with overlapped pairs as their two sub-steps, in order."""
    return [sub for step in schedule for sub in (step.sub_steps or (step,))]


def sync_microbatches(schedule: list[MetaStep]) -> dict[int, int]:
    """Stage -> the micro-batch of its last backward in this rank's schedule: the one that runs the
    sync variant and reduces the step's gradients (passes/pipeline_split.py)."""
    return {step.stage: step.micro_batch for step in flat_steps(schedule) if step.step_type is T.BACKWARD}


def program_for(program: StageProgram, mb: int, sync_mb: dict[int, int]) -> StageProgram:
    """The variant of ``program`` that runs micro-batch ``mb``."""
    sync = getattr(program, "sync", None)  # (stand-ins for a StageProgram may lack it)
    return sync if sync is not None and sync_mb.get(program.stage) == mb else program


@dataclasses.dataclass
class StageProgram:
    """One stage's compiled programs and the description of their inputs and outputs.

    With gradient reduction once per step (passes/pipeline_split.py) this is the *no-sync* variant: backward
    returns the local unreduced gradients of ``deferred`` parameters, and ``sync`` is the variant
    that runs the stage's last micro-batch of the step (it takes their pending sums as
    ``grad_accum`` inputs and reduces once). Without deferred gradients ``sync`` is None and this
    program runs every micro-batch."""

    stage: int
    forward_gm: torch.fx.GraphModule
    backward_gm: torch.fx.GraphModule
    graph: StageGraph
    deferred: frozenset = frozenset()
    sync: "StageProgram | None" = None

    def __post_init__(self):
        graph = self.graph
        self.num_forward_outputs = graph.num_forward_outputs
        # What backward returns one gradient slot for (then its sends), and the transfers each
        # program's trailing outputs are, in order.
        self.primal_infos = [i for i in graph.inputs if i.kind not in (InputKind.TANGENT, RECV_BWD, GRAD_ACCUM)]
        by_key = {(t.name, t.dst): t for t in graph.sends}
        self.sends = {
            phase: [by_key[(i.name, i.index)] for i in graph.outputs if i.kind == kind]
            for phase, kind in ((FORWARD, SEND_FWD), (BACKWARD, SEND_BWD))
        }


@dataclasses.dataclass
class StepTiming:
    """Measured compute intervals of one step on this rank (seconds from the step's start)."""

    events: list  # (MetaStep repr, stage, start_s, end_s)
    step_s: float

    def bubble_fraction(self) -> float:
        busy = sum(end - start for _, _, start, end in self.events)
        return 1.0 - busy / self.step_s if self.step_s > 0 else 0.0


class PipelineExecutor:
    """Runs one training step of this rank's stages under a schedule."""

    def __init__(self, programs: dict[int, StageProgram], schedule: list[MetaStep], transfers: list[Transfer],
                 num_ranks: int, num_microbatches: int, pp_group, device: torch.device, loss_dtype: torch.dtype,
                 token_mean: bool = False):
        self.programs = programs
        self.token_mean = token_mean  # the last stage returns its loss's token count (pipeline/loss.py)
        self.schedule = schedule
        self.num_ranks = num_ranks
        self.num_microbatches = num_microbatches
        self.pp_group = pp_group
        self.device = device
        self.loss_dtype = loss_dtype
        self.sync_mb = sync_microbatches(schedule)
        self.tag_of = {(t.name, t.dst): i for i, t in enumerate(transfers)}
        self.num_transfers = max(len(transfers), 1)
        self.last_timing: StepTiming | None = None

    # --- peers ---------------------------------------------------------------------------------
    def _is_local(self, stage: int) -> bool:
        return stage in self.programs

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.pp_group, stage % self.num_ranks)

    def _tag(self, transfer: Transfer, mb: int) -> int:
        return mb * self.num_transfers + self.tag_of[(transfer.name, transfer.dst)]

    # --- one step ------------------------------------------------------------------------------
    def run(self, module, micro_batches: list[list]) -> tuple[torch.Tensor | None, torch.Tensor | None, dict]:
        """Run the schedule. ``micro_batches[mb]``: the flat inputs of micro-batch ``mb``. Returns
        (on the last stage's rank the loss, else None; there the step's token count when the loss
        is a token mean, else None; {parameter FQN: local gradient}). With a token count the
        gradients are those of the summed loss: the caller divides them by the count."""
        params = {fqn: p for fqn, p in module.named_parameters()}
        buffers = {fqn: b for fqn, b in module.named_buffers()}
        received: dict = {}  # (value name, dst stage, mb) -> tensor (being received while in pending_recv)
        pending_recv: dict = {}  # (value name, dst stage, mb) -> the receive's work handle
        saved: dict = {}  # (stage, mb) -> saved tensors
        outgoing: dict = {}  # (stage, mb, phase) -> {transfer: tensor}
        in_flight_sends: list = []  # (work, tensors): a sent value lives until its send completes
        grads: dict[str, torch.Tensor] = {}
        pending: dict[str, torch.Tensor] = {}  # FQN -> sum of the local unreduced gradients so far
        loss_sum = count_sum = None
        seeds: dict[int, torch.Tensor] = {}  # micro-batch -> its backward's starting gradient
        scale = 1.0 / self.num_microbatches
        events = []
        t0 = time.perf_counter()

        for step in self.schedule:
            kind, s, mb = step.step_type, step.stage, step.micro_batch
            program = program_for(self.programs[s], mb, self.sync_mb)
            if kind in (T.FWD_RECV, T.BWD_RECV):
                phase = FORWARD if kind is T.FWD_RECV else BACKWARD
                ops, keys = [], []
                for t in program.graph.recvs:
                    if t.phase != phase or self._is_local(t.src):
                        continue
                    buf = torch.empty(t.shape, dtype=t.dtype, device=self.device)
                    ops.append(dist.P2POp(dist.irecv, buf, self._peer(t.src), self.pp_group, self._tag(t, mb)))
                    keys.append(((t.name, s, mb), buf))
                if ops:
                    works = dist.batch_isend_irecv(ops)
                    for (key, buf), work in zip(keys, works):
                        received[key] = buf
                        pending_recv[key] = work
            elif kind in (T.FWD_SEND, T.BWD_SEND):
                phase = FORWARD if kind is T.FWD_SEND else BACKWARD
                ops, values = [], []
                for t, value in outgoing.pop((s, mb, phase), {}).items():
                    value = value.contiguous()
                    ops.append(dist.P2POp(dist.isend, value, self._peer(t.dst), self.pp_group, self._tag(t, mb)))
                    values.append(value)
                if ops:
                    in_flight_sends.extend((work, values) for work in dist.batch_isend_irecv(ops))
                # Drop what has been sent (a GPipe first stage would otherwise hold every
                # micro-batch's activations until the step ends).
                in_flight_sends = [(w, v) for w, v in in_flight_sends if not w.is_completed()]
            elif kind is T.FORWARD:
                primals = []
                for info in program.graph.inputs:
                    if info.kind == InputKind.PARAM:
                        primals.append(_local(params[info.name]))
                    elif info.kind == InputKind.BUFFER:
                        primals.append(_local(buffers[info.name]))
                    elif info.kind == InputKind.INPUT:
                        primals.append(micro_batches[mb][info.index])
                    elif info.kind == RECV_FWD:
                        primals.append(self._take(received, pending_recv, (info.name, s, mb)))
                start = time.perf_counter() - t0  # after the receives: waiting is bubble
                with torch.no_grad():  # the programs are forward and backward already
                    outs = program.forward_gm(*primals)
                n = program.num_forward_outputs
                saved[(s, mb)] = list(outs[n:])
                self._route(program.sends[FORWARD], outs[n - len(program.sends[FORWARD]):n], s, mb, FORWARD,
                            outgoing, received)
                results = {info.kind: value.detach() for value, info in zip(outs[:n], program.graph.outputs)
                           if info.kind in (OutputKind.OUTPUT, LOSS_COUNT)}
                if LOSS_COUNT in results:  # a token mean: weigh each micro-batch by its tokens
                    count = results[LOSS_COUNT].to(self.loss_dtype)
                    contrib = summed_loss(results["output"], count)
                    count_sum = count if count_sum is None else count_sum + count
                    seeds[mb] = count
                elif "output" in results:
                    contrib = results["output"] * scale
                if results:
                    loss_sum = contrib if loss_sum is None else loss_sum + contrib
                events.append((repr(step), s, start, time.perf_counter() - t0))
            elif kind is T.BACKWARD:
                tangents = []
                for info in program.graph.inputs:
                    if info.kind == InputKind.TANGENT:
                        seed = seeds.pop(mb, None)
                        tangents.append(seed if seed is not None else
                                        torch.full((), scale, dtype=self.loss_dtype, device=self.device))
                    elif info.kind == RECV_BWD:
                        tangents.append(self._take(received, pending_recv, (info.name, s, mb)))
                    elif info.kind == GRAD_ACCUM:  # the sync variant reduces them with its own
                        tangents.append(pending.pop(info.name))
                args = saved.pop((s, mb)) + tangents
                start = time.perf_counter() - t0
                with torch.no_grad():
                    outs = program.backward_gm(args)
                for info, g in zip(program.primal_infos, outs):
                    if info.kind == InputKind.PARAM and g is not None:
                        # Unreduced (no-sync variant) gradients wait for the sync variant.
                        into = pending if info.name in program.deferred else grads
                        if info.name in into:
                            into[info.name].add_(g)  # the first one is this step's own buffer
                        else:
                            into[info.name] = g
                self._route(program.sends[BACKWARD], outs[len(program.primal_infos):], s, mb, BACKWARD,
                            outgoing, received)
                events.append((repr(step), s, start, time.perf_counter() - t0))
            else:
                raise internal_error(
                    "the pipeline executor", f"step {step!r} of type {kind.name} is not supported (the "
                    "built schedules run forward, backward, send and receive steps only)",
                    workaround="another PipelinePlan(schedule=...)",
                )
        for work, _ in in_flight_sends:
            work.wait()
        if saved or pending_recv or pending:
            # A forward without its backward (or a value received for nothing, or gradients no
            # sync variant reduced): missing gradients.
            left = []
            if saved:
                left.append(f"the saved activations of (stage, micro-batch) {sorted(saved)}, whose backward did not run")
            if pending_recv:
                left.append(f"the receives {sorted(pending_recv)}, which no step read")
            if pending:
                left.append(f"the unreduced gradients of {sorted(pending)[:3]}, which no sync backward reduced")
            raise internal_error(
                "the pipeline executor", f"the step ended with {' and '.join(left)}, so the gradients would be "
                "incomplete", workaround="another PipelinePlan(schedule=...)",
            )
        self.last_timing = StepTiming(events, time.perf_counter() - t0)
        if count_sum is not None:
            loss_sum = loss_sum / count_sum
        return loss_sum, count_sum, grads

    def _take(self, received: dict, pending: dict, key):
        work = pending.pop(key, None)
        if work is not None:
            work.wait()
        return received.pop(key)

    def _route(self, sends: list[Transfer], values, s: int, mb: int, phase: str, outgoing: dict,
               received: dict) -> None:
        """Values this stage sends: to a stage on this rank in memory now, else at its SEND step."""
        for t, value in zip(sends, values, strict=True):
            if self._is_local(t.dst):
                received[(t.name, t.dst, mb)] = value
            else:
                outgoing.setdefault((s, mb, phase), {})[t] = value


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t
