"""The pipeline executor: runs this rank's stage programs over micro-batches, step by step of a schedule.

Each stage is a pair of GraphModules (forward, backward) cut from one joint graph
(passes/pipeline_split.py) and partitioned like any compiled program (the backward cut once more
into input- and weight-gradient programs for a zero-bubble schedule). The executor walks this
rank's list of :class:`~hyper_parallel.pipeline.schedules.MetaStep`:

* ``FWD_RECV`` / ``BWD_RECV`` post the receives of every value the stage reads from other ranks for
  that micro-batch (``torch.distributed`` ``irecv`` into buffers of the recorded shape and dtype);
* ``FORWARD`` waits for them, runs the forward program and keeps its saved tensors per micro-batch;
  ``BACKWARD`` runs the backward program on them, the received gradients and the step's running
  gradient sums, and frees the saved tensors. The programs sum the micro-batch gradients themselves
  (passes/pipeline_split.py): backward takes each parameter's running sum as a ``grad_accum`` input,
  adds it where the gradient is made and returns the new sum, so the sums and one new gradient are
  alive at a time; the stage's first micro-batch runs its *first* variant, which has no sum to take.
  Gradients are reduced once per step: the micro-batches run no-sync variants, whose sums stay local
  and unreduced, except the micro-batch of the stage's last backward in the schedule, which runs
  the *sync* variant: it reduces the sums once with the fused collectives;
* zero-bubble schedules (ZB-H1) split each backward in two (``runtime/partition.py:split_backward``,
  both variants): ``BACKWARD_INPUT`` runs the input-gradient program I on the saved tensors it
  reads and the received gradients, routes its sends, keeps I's hand-off (values W reads) and the
  backward inputs only W reads, and frees the other saved tensors; ``BACKWARD_WEIGHT`` runs the
  weight-gradient program W on those later, with the ``grad_accum`` sums (I never reads them), and
  frees them. The sync variant runs the micro-batch of the stage's last W, which holds the
  reductions (they read only parameter gradients);
* ``FWD_SEND`` / ``BWD_SEND`` post ``isend`` of the values other stages read, batched per step.

Values between two stages on the same rank (interleaved schedules with one pp rank) are handed
over in memory. Messages carry a tag derived from (value, micro-batch), so a backend that matches
by tag (gloo) pairs them exactly; NCCL / HCCL match by order, which every schedule keeps, custom
ones included (schedules.check_schedule: each rank posts a pair's receives in the order the peer
sends them).

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

from ..ir.kinds import InputKind, OutputKind
from ..errors import internal_error
from ..passes.pipeline_split import LOSS_COUNT, RECV_BWD, RECV_FWD, SEND_BWD, SEND_FWD, StageGraph, Transfer
from ..ir.phase import BACKWARD, FORWARD
from ..runtime.agreement_gate import await_agreement
from ..runtime.partition import BackwardSplit
from .. import compat
from .loss import summed_loss
from .schedules import MetaStep, MetaStepType

T = MetaStepType
GRAD_ACCUM = InputKind.GRAD_ACCUM


def flat_steps(schedule: list[MetaStep]) -> list[MetaStep]:
    """The schedule's steps with overlapped pairs as their two sub-steps, in order."""
    return [sub for step in schedule for sub in (step.sub_steps or (step,))]


def first_microbatches(schedule: list[MetaStep]) -> dict[int, int]:
    """Stage -> the micro-batch of its first backward in this rank's schedule (its first
    BACKWARD_WEIGHT when backwards are split: parameter gradients are made there): the one that runs
    the first variant, which has no gradient sums to take yet (passes/pipeline_split.py)."""
    firsts: dict[int, int] = {}
    for step in flat_steps(schedule):
        if step.step_type in (T.BACKWARD, T.BACKWARD_WEIGHT):
            firsts.setdefault(step.stage, step.micro_batch)
    return firsts


def sync_microbatches(schedule: list[MetaStep]) -> dict[int, int]:
    """Stage -> the micro-batch of its last backward in this rank's schedule (its last
    BACKWARD_WEIGHT when backwards are split: parameter gradients are complete only after it): the
    one that runs the sync variant and reduces the step's gradients (passes/pipeline_split.py)."""
    return {step.stage: step.micro_batch for step in flat_steps(schedule)
            if step.step_type in (T.BACKWARD, T.BACKWARD_WEIGHT)}


def program_for(program: StageProgram, mb: int, first_mb: dict[int, int], sync_mb: dict[int, int]) -> StageProgram:
    """The variant of ``program`` that runs micro-batch ``mb`` (every step of it: forward, backward,
    or I and W, so the saved tensors and hand-offs fit)."""
    # (Stand-ins for a StageProgram may lack the variants.)
    sync, first = getattr(program, "sync", None), getattr(program, "first", None)
    if sync is not None and sync_mb.get(program.stage) == mb:
        return sync
    if first is not None and first_mb.get(program.stage) == mb:
        return first
    return program


def variants_of(program: StageProgram) -> list[StageProgram]:
    """``program`` and its first and sync variants, where it has them."""
    return [p for p in (program, program.first, program.sync) if p is not None]


@dataclasses.dataclass
class StageProgram:
    """One stage's compiled programs (one variant) and the description of their inputs and outputs.

    With several micro-batches a stage has variants (passes/pipeline_split.py): the program the
    executor holds runs the micro-batches between the first and the last, ``first`` (no gradient
    sums to take) the stage's first and ``sync`` its last, where they differ (``program_for``).
    The backward of all but ``first`` takes the step's running sum of each parameter gradient
    (``grad_accum`` inputs) and returns the new sum; the sums of ``deferred`` parameters stay local
    and unreduced until ``sync`` reduces them once."""

    stage: int
    forward_gm: torch.fx.GraphModule
    backward_gm: torch.fx.GraphModule
    graph: StageGraph
    deferred: frozenset = frozenset()
    sync: "StageProgram | None" = None
    first: "StageProgram | None" = None  # the variant of the stage's first micro-batch (no sums to take)
    name_suffix: str = ""  # of its summary names (api.NO_SYNC, api.FIRST)
    split: BackwardSplit | None = None  # backward_gm cut into I and W (weight_outputs, compile/programs.py)
    # What runs in place of each program ("forward", "backward", "backward_input",
    # "backward_weight") with codegen="inductor" (codegen.generate); the GraphModules otherwise.
    runners: dict = dataclasses.field(default_factory=dict)

    def run(self, name: str):
        """The callable to run for program ``name`` (module docstring of codegen)."""
        runner = self.runners.get(name)
        if runner is not None:
            return runner
        return {"forward": self.forward_gm, "backward": self.backward_gm,
                "backward_input": self.split.input_gm if self.split else None,
                "backward_weight": self.split.weight_gm if self.split else None}[name]

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
        # Backward's inputs: the saved tensors, then these, in this order.
        self.tangent_infos = [i for i in graph.inputs if i.kind in (InputKind.TANGENT, RECV_BWD, GRAD_ACCUM)]

    def grad_accum_args(self) -> list[int]:
        """Indices of backward's inputs that are ``grad_accum`` sums (after the saved tensors)."""
        num_saved = sum(1 for n in self.backward_gm.graph.nodes if n.op == "placeholder") - len(self.tangent_infos)
        return [num_saved + k for k, info in enumerate(self.tangent_infos) if info.kind == GRAD_ACCUM]


def weight_outputs(graph: StageGraph) -> list[int]:
    """The output slots of a stage's backward that are parameter gradients: the cut of a
    split-backward schedule gives them (with their reductions, in a sync variant) to the
    weight-gradient program (``compile/programs.build_programs``, ``runtime/partition.py:split_backward``).
    Backward returns one slot per primal input, in order, then its sends."""
    primals = [i for i in graph.inputs if i.kind not in (InputKind.TANGENT, RECV_BWD, GRAD_ACCUM)]
    return [i for i, info in enumerate(primals) if info.kind == InputKind.PARAM]


def check_split(program: StageProgram) -> None:
    """A split backward's input-gradient program I must not read the step's pending gradient
    sums: it runs before the other micro-batches' weight-gradient steps have added to them."""
    accum = set(program.grad_accum_args())
    if accum & set(program.split.input_args):
        raise internal_error(
            "the zero-bubble backward split", f"stage {program.stage}'s input-gradient program reads the "
            "pending gradient sums (grad_accum inputs), which only its weight-gradient program may read",
            workaround="another PipelinePlan(schedule=...), e.g. '1F1B'",
        )


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
        self.first_mb, self.sync_mb = first_microbatches(schedule), sync_microbatches(schedule)
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
    def run(self, module, micro_batches: list[list], forward_only: bool = False,
            ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict]:
        """Run the schedule. ``micro_batches[mb]``: the flat inputs of micro-batch ``mb``. Returns
        (on the last stage's rank the loss, else None; there the step's token count when the loss
        is a token mean, else None; {parameter FQN: local gradient}). With a token count the
        gradients are those of the summed loss: the caller divides them by the count.
        ``forward_only``: the schedule's forward, receive and send steps of the forward only (an
        evaluation: no activation kept, no gradient)."""
        params = {fqn: p for fqn, p in module.named_parameters()}
        buffers = {fqn: b for fqn, b in module.named_buffers()}
        received: dict = {}  # (value name, dst stage, mb) -> tensor (being received while in pending_recv)
        pending_recv: dict = {}  # (value name, dst stage, mb) -> the receive's work handle
        saved: dict = {}  # (stage, mb) -> saved tensors
        handoff: dict = {}  # (stage, mb) -> what its BACKWARD_WEIGHT reads (_HandOff), from its BACKWARD_INPUT
        outgoing: dict = {}  # (stage, mb, phase) -> {transfer: tensor}
        in_flight_sends: list = []  # (work, tensors): a sent value lives until its send completes
        # FQN -> the step's gradient sum so far (local and unreduced while ``unreduced`` names it,
        # until the stage's sync program reduces it); the gradients at the end.
        grads: dict[str, torch.Tensor] = {}
        unreduced: set[str] = set()
        loss_sum = count_sum = None
        seeds: dict[int, torch.Tensor] = {}  # micro-batch -> its backward's starting gradient
        scale = 1.0 / self.num_microbatches
        events = []
        t0 = time.perf_counter()

        for step in self.schedule:
            kind, s, mb = step.step_type, step.stage, step.micro_batch
            if forward_only and kind not in _FORWARD_STEPS:
                continue
            program = program_for(self.programs[s], mb, self.first_mb, self.sync_mb)
            # Transfers and backward programs (their reductions) come after the step's agreement;
            # a forward program waits for it at its own first collective (runtime/agreement_gate.py),
            # so the first stage computes while it is exchanged.
            if kind not in _FORWARD_STEPS:
                await_agreement()
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
                    await_agreement()
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
                    await_agreement()
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
                    outs = program.run("forward")(*primals)
                n = program.num_forward_outputs
                if not forward_only:
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
            elif kind in (T.BACKWARD, T.BACKWARD_INPUT):
                split = kind is T.BACKWARD_INPUT
                # A split backward's grad_accum sums are read by its W, when every other W has run.
                args, accum = self._backward_args(program, s, mb, saved, received, pending_recv, seeds, grads,
                                                  scale, defer_accum=split)
                start = time.perf_counter() - t0
                if split:
                    cut = program.split
                    i_args = [args[i] for i in cut.input_args]
                    # W's own inputs stay; the saved tensors only I read go with ``args``.
                    direct = {i: args[i] for i in cut.weight_args if i not in accum}
                    del args
                    with torch.no_grad():
                        outs = program.run("backward_input")(i_args)
                    num = len(cut.input_outputs)
                    handoff[(s, mb)] = _HandOff(list(outs[num:]), direct, accum)
                    sends = outs[num - len(program.sends[BACKWARD]):num]
                else:
                    with torch.no_grad():
                        outs = program.run("backward")(args)
                    del args
                    self._add_gradients(program, zip(program.primal_infos, outs), grads, unreduced)
                    sends = outs[len(program.primal_infos):]
                self._route(program.sends[BACKWARD], sends, s, mb, BACKWARD, outgoing, received)
                del outs, sends
                events.append((repr(step), s, start, time.perf_counter() - t0))
            elif kind is T.BACKWARD_WEIGHT:
                cut, given = program.split, handoff.pop((s, mb))
                sums = {i: self._running_sum(grads, name) for i, name in given.accum.items()}
                w_args = given.values + [sums[i] if i in sums else given.direct[i] for i in cut.weight_args]
                del given, sums
                start = time.perf_counter() - t0
                with torch.no_grad():
                    outs = program.run("backward_weight")(w_args)
                self._add_gradients(program, ((program.primal_infos[slot], g) for slot, g
                                              in zip(cut.weight_outputs, outs, strict=True)), grads, unreduced)
                del outs
                events.append((repr(step), s, start, time.perf_counter() - t0))
            else:
                raise internal_error(
                    "the pipeline executor", f"step {step!r} of type {kind.name} is not supported (the "
                    "built schedules run forward, backward (whole or split into input and weight "
                    "gradients), send and receive steps only)",
                    workaround="another PipelinePlan(schedule=...)",
                )
        for work, _ in in_flight_sends:
            work.wait()
        if saved or handoff or pending_recv or unreduced:
            # A forward without its backward (or an input gradient without its weight gradient, a
            # value received for nothing, gradients no sync variant reduced): missing gradients.
            left = []
            if saved:
                left.append(f"the saved activations of (stage, micro-batch) {sorted(saved)}, whose backward did not run")
            if handoff:
                left.append(f"the input-gradient hand-offs of (stage, micro-batch) {sorted(handoff)}, whose "
                            "BACKWARD_WEIGHT did not run")
            if pending_recv:
                left.append(f"the receives {sorted(pending_recv)}, which no step read")
            if unreduced:
                left.append(f"the unreduced gradients of {sorted(unreduced)[:3]}, which no sync backward reduced")
            raise internal_error(
                "the pipeline executor", f"the step ended with {' and '.join(left)}, so the gradients would be "
                "incomplete", workaround="another PipelinePlan(schedule=...)",
            )
        self.last_timing = StepTiming(events, time.perf_counter() - t0)
        if count_sum is not None:
            loss_sum = loss_sum / count_sum
        return loss_sum, count_sum, grads

    def _backward_args(self, program: StageProgram, s: int, mb: int, saved: dict, received: dict,
                       pending_recv: dict, seeds: dict, grads: dict, scale: float,
                       defer_accum: bool) -> tuple[list, dict[int, str]]:
        """Backward's inputs for micro-batch ``mb``: its saved tensors, then the loss's seed, the
        received gradients and the running sums (``grad_accum``), and {input index: FQN} of the sums
        left out (None) with ``defer_accum``, for the W step to read when it runs."""
        args, accum = saved.pop((s, mb)), {}
        for info in program.tangent_infos:
            if info.kind == InputKind.TANGENT:
                seed = seeds.pop(mb, None)
                args.append(seed if seed is not None else
                            torch.full((), scale, dtype=self.loss_dtype, device=self.device))
            elif info.kind == RECV_BWD:
                args.append(self._take(received, pending_recv, (info.name, s, mb)))
            elif defer_accum:
                accum[len(args)] = info.name
                args.append(None)
            else:  # GRAD_ACCUM
                args.append(self._running_sum(grads, info.name))
        return args, accum

    @staticmethod
    def _running_sum(grads: dict, fqn: str) -> torch.Tensor:
        """The step's sum of ``fqn``'s gradient so far, taken out of ``grads``: the program adds into
        it in place and returns it, and the executor keeps no other reference meanwhile."""
        total = grads.pop(fqn, None)
        if total is None:
            raise internal_error(
                "the pipeline executor", f"a backward program takes the running gradient sum of {fqn}, which "
                "no earlier micro-batch of its stage made (the first micro-batch's variant makes it)",
                workaround="another PipelinePlan(schedule=...)",
            )
        return total

    @staticmethod
    def _add_gradients(program: StageProgram, slots, grads: dict, unreduced: set) -> None:
        """Take a backward's parameter gradients ((InputInfo, gradient) pairs) into this step's."""
        for info, g in slots:
            if info.kind != InputKind.PARAM or g is None:
                continue
            # The new running sum (a program that takes the sum took it out of ``grads``), or the
            # stage's first gradient. (No built schedule runs a program without sums twice for a
            # stage in one step; were one to, its gradients are still added, not dropped.)
            if info.name in grads:
                grads[info.name].add_(g)
            else:
                grads[info.name] = g
            # The no-sync variant's sums wait for the sync variant to reduce them.
            if info.name in program.deferred:
                unreduced.add(info.name)
            else:
                unreduced.discard(info.name)

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


_FORWARD_STEPS = (T.FORWARD, T.FWD_RECV, T.FWD_SEND)


@dataclasses.dataclass
class _HandOff:
    """What a BACKWARD_INPUT leaves for its BACKWARD_WEIGHT: I's hand-off values, the backward inputs
    only W reads ({input index: tensor}) and the ``grad_accum`` sums W reads ({input index: FQN})."""

    values: list
    direct: dict
    accum: dict


def _local(t):
    # The stage programs compute their own gradients: no autograd node (``to_local``) needed.
    return compat.plain_tensor(t)
