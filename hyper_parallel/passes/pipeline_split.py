"""pipeline split: cut the lowered local joint graph into one joint graph per pipeline stage.

Runs between lowering and the ordered pass pipeline (each stage's graph then goes through every
pass and the forward/backward partition on its own), so tensor parallelism, FSDP, recompute and
swap work inside a stage unchanged.

Which stage a node belongs to:

* forward nodes with a module stack, in graph (execution) order: stage ``k`` begins at the first
  node inside split point ``k - 1``'s module, so everything after it (later layers, the final norm,
  the loss) belongs to stage ``k`` until the next split point begins;
* backward nodes: the stage of their forward module (``fwd_nn_module_stack``);
* nodes without a module (gradient sums, collectives and copies lowering or propagation added):
  where their data is (forward: the latest stage among their inputs; backward: the earliest), else
  the stage of the forward op with their autograd ``seq_nr``, else where their users are (forward
  nodes that read only placeholders, such as FSDP's mixed-precision cast of a parameter shard,
  go straight to their users: the parameter then lives in the stage that uses it; so do constants
  made in backward, such as the vocab-parallel loss's fill value of its masked targets). The
  stage a ``seq_nr`` names comes from the ops the model ran, and only where they are all in one
  stage: a redistribution carries the number of the node it was made for, and the nodes added
  after capture (FSDP's casts, hence its all-gathers) share the last forward op's, the loss's; the
  embedding's all-gather in stage 0 once sent the loss's backward there;
* placeholders and constants are copied into every stage that reads them, except a parameter read
  by two stages (tied weights), which is an error: its gradient would be split between them;
* forward values computed from buffers and constants alone (rotary tables, masks) are recomputed
  by every stage that reads them instead of being sent each micro-batch.

A value computed in stage ``a`` and read in stage ``b`` crosses the cut: in forward it must go to a
later stage (sent after ``a``'s forward, received before ``b``'s), in backward to an earlier one.
Anything else is an error naming the node and its source line.

**Gradient reduction once per step, not once per micro-batch.**

A stage's joint graph, as lowering made it, ends every parameter gradient with its data-parallel
reduction: the redistribution of the gradient output slot to the parameter's storage layout
(``hp_grad_of``; an FSDP reduce-scatter, HSDP's reduce-scatter then all-reduce, a replicated
parameter's all-reduce), which the bucketing pass then fuses. Run once per micro-batch, that
communicates M times the gradient volume of a step. Every redistribution is linear (sums, slices,
concatenations, division by a constant), so reducing the sum of the M local gradients once gives the
same numbers. And the M micro-batch gradients are summed by the programs themselves: a
micro-batch's backward takes the step's sum so far of each parameter gradient (one ``grad_accum``
backward input per gradient slot, as ``propagation/accumulation.py`` adds for FSDP accumulation)
and adds the gradient into it in place right where the gradient is made (where its reduction
would start), so it holds the sums plus the gradient being made, as autograd's ``.grad``
accumulation does; summed by the
executor after the program returned, the sums and all of the micro-batch's new gradients were alive
together (a 1.07x peak against torch.distributed.pipelining, docs/benchmarks.md). Each stage
therefore gets up to three variants of its joint graph (``gradient_variant``), built before the
passes run:

* **first** (the stage's first backward of the step): no sums to take yet; deferred reductions
  removed, each such slot returns the local, unreduced gradient (the value its reduction started
  from). (Zeros passed as sums would serve too, but allocate all the sums at the start of the first
  backward, where GPipe holds every micro-batch's activations: 1.14x torch's peak, measured.)
* **no sync** (the micro-batches in between): takes the sums, returns the new local sums, no
  reduction, as ``set_requires_gradient_sync(False)`` keeps FSDP gradients aside
  (``fsdp/grad_accumulation.py``).
* **sync** (the stage's last backward of the step in the schedule): takes the sums and reduces them
  once; the passes then fuse and schedule these reductions as in any program.

With no reduction to defer (a stage mesh of one rank, tensor-parallel shards only) "no sync" and
"sync" are one program; with two micro-batches there is no "no sync".

Why this and not a separate "reduce" program run after the last backward: the sync variant's
reductions are the same nodes as before, so bucketing fuses them per FSDP unit / DDP bucket and
prefetch issues each unit's reduce-scatter right after that unit's backward, overlapped with the
rest of the last micro-batch's backward, exactly as the per-micro-batch programs did (Megatron
and torch.distributed.pipelining also reduce during the last backward). A reduce-only program would
start communicating only after all compute, with nothing to overlap, and would be one more program
per stage going through the passes with phases of its own. The cost of either: the pending local
gradients of a stage live from its first backward to its last (for FSDP, unsharded, as FSDP's
no-sync accumulation keeps them). The pending inputs are tangents (backward inputs), so the forward
of the last micro-batch, which 1F1B runs before the earlier micro-batches' backwards, does not take
them.

Reads: ``partitioner_tag`` / ``hp_fsdp_phase`` (phase), ``nn_module_stack``,
``fwd_nn_module_stack``, ``seq_nr``, ``hp_role`` (the redistributions lowering added), ``val``; for
the variants ``hp_grad_of`` and ``hp_role``.
Writes: new GraphModules (the input graph is not changed); every stage node keeps its meta; the
variants' adds get ``hp_role = "accumulate"`` and the backward tag.
"""

from __future__ import annotations

import dataclasses

import torch

from ..ir.kinds import InputKind, OutputKind
from .. import compat
from ..ir.graph import CapturedGraph, InputInfo, OutputInfo, _normalize_fqn, source_line
from ..ir.collectives import COLLECTIVE_KINDS
from ..ir import meta
from ..ir.phase import BACKWARD, FORWARD, phases_of, tag

RECV_FWD, RECV_BWD = InputKind.RECV_FWD, InputKind.RECV_BWD
SEND_FWD, SEND_BWD = OutputKind.SEND_FWD, OutputKind.SEND_BWD
# OutputInfo kind: the token count a micro-batch's mean loss divides by (pipeline/loss.py); a
# forward output of the last stage, like the loss.
LOSS_COUNT = OutputKind.LOSS_COUNT
_FORWARD_OUTPUTS = (OutputKind.OUTPUT, LOSS_COUNT)
GRAD_ACCUM = InputKind.GRAD_ACCUM  # the step's running gradient sums (backward inputs)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One value crossing a cut: ``name`` is its node in the lowered joint graph (unique)."""

    name: str
    src: int
    dst: int
    phase: str  # FORWARD or BACKWARD
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclasses.dataclass
class StageGraph:
    """One stage's joint graph, with its placeholders and outputs described like a captured graph:
    primals (parameters, buffers, inputs, forward-received values) then tangents (the loss's and
    backward-received values); outputs are the user outputs and forward sends, then one gradient
    slot per primal and the backward sends."""

    stage: int
    gm: torch.fx.GraphModule
    inputs: list[InputInfo]
    outputs: list[OutputInfo]
    num_forward_outputs: int
    sends: list[Transfer]
    recvs: list[Transfer]


def _module_paths(node: torch.fx.Node, key: str) -> list[str]:
    stack = node.meta.get(key) or {}
    return [_normalize_fqn(path) for path, _ in stack.values()]


def _inside(paths: list[str], module: str) -> bool:
    return any(p == module or p.startswith(module + ".") for p in paths)


def _describe(node: torch.fx.Node) -> str:
    line = source_line(node)
    return f"node {node.name} ({node.target})" + (f" at {line}" if line else "")


def assign_stages(gm: torch.fx.GraphModule, split_points: tuple[str, ...]) -> tuple[dict, dict]:
    """(node -> stage for computing nodes, node -> phase). Placeholders and get_attr get no stage."""
    nodes = list(gm.graph.nodes)
    phases = phases_of(gm.graph)
    stage: dict = {}
    computing = [n for n in nodes if n.op == "call_function"]

    # Forward nodes with a module stack: order-based.
    begins = {}
    for i, node in enumerate(computing):
        if phases[node] != FORWARD:
            continue
        paths = _module_paths(node, "nn_module_stack")
        for k, point in enumerate(split_points):
            if k not in begins and _inside(paths, point):
                begins[k] = i
    missing = [p for k, p in enumerate(split_points) if k not in begins]
    if missing:
        raise ValueError(
            f"pipeline split points {missing} are modules the forward pass never runs; a split point "
            "must be a module the model calls (e.g. 'model.layers.2')"
        )
    order = [begins[k] for k in range(len(split_points))]
    if order != sorted(order):
        raise ValueError(
            f"pipeline split points {list(split_points)} are not in execution order; list them in the "
            "order the model runs the modules"
        )
    seq_stages: dict[int, set] = {}
    by_module: dict[str, set] = {}
    for i, node in enumerate(computing):
        if phases[node] != FORWARD or not node.meta.get("nn_module_stack"):
            continue
        stage[node] = sum(1 for b in order if b <= i)
        # Only the ops the model ran number a forward op: a redistribution carries its source
        # node's number, and an FSDP all-gather's source (the mixed-precision cast, added after
        # capture) the last forward op's, the loss's: the embedding's all-gather, in stage 0, put
        # the vocab-parallel loss's backward there (2-layer Llama, FSDP x TP x PP).
        if node.meta.get("seq_nr") is not None and not meta.is_redistribute(node):
            seq_stages.setdefault(node.meta["seq_nr"], set()).add(stage[node])
        for path in _module_paths(node, "nn_module_stack"):
            by_module.setdefault(path, set()).add(stage[node])
    # A number seen in two stages names no forward op: left to the data and users rules below.
    by_seq = {seq: next(iter(s)) for seq, s in seq_stages.items() if len(s) == 1}

    # Backward nodes: the stage of the module they differentiate.
    for node in computing:
        if phases[node] != BACKWARD:
            continue
        paths = _module_paths(node, "fwd_nn_module_stack")
        if paths and len(by_module.get(paths[-1], ())) == 1:
            stage[node] = next(iter(by_module[paths[-1]]))

    # The rest follows its data: forward ASAP after its inputs, backward at its earliest input (so
    # gradients only flow to earlier stages); then the forward op with the same autograd sequence
    # number (not first: autograd's gradient sums carry the number of an unrelated later op).
    # A forward node reading only placeholders (FSDP's mixed-precision cast of a parameter shard,
    # whose seq_nr is one shared by every node lowering adds) goes where its users are, below; so
    # does a constant made in backward (no inputs: ``scalar_tensor``, ``full``), which has no data
    # to follow and would otherwise pull its users, by the earliest-input rule, to its stage.
    for node in computing:
        if node in stage:
            continue
        inputs = [stage[a] for a in node.all_input_nodes if a in stage]
        if inputs:
            stage[node] = max(inputs) if phases[node] == FORWARD else min(inputs)
        elif phases[node] == FORWARD and all(a.op in ("placeholder", "get_attr") for a in node.all_input_nodes):
            continue
        elif not node.all_input_nodes:
            continue
        elif node.meta.get("seq_nr") in by_seq:
            stage[node] = by_seq[node.meta["seq_nr"]]
    # Where the users are: the earliest in forward, the latest in backward, so that the value flows
    # the one way it may to the others.
    for node in reversed(computing):
        if node in stage:
            continue
        users = [stage[u] for u in node.users if u in stage]
        stage[node] = (min(users) if phases[node] == FORWARD else max(users)) if users else 0
    return stage, phases


def split_stages(
    gm: torch.fx.GraphModule, captured: CapturedGraph, split_points: tuple[str, ...], num_stages: int,
) -> list[StageGraph]:
    """One :class:`StageGraph` per stage (see the module docstring)."""
    stage, phases = assign_stages(gm, split_points)
    last = num_stages - 1
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    info_of = dict(zip(placeholders, captured.inputs))
    out_node = gm.graph.output_node()
    slots = list(out_node.args[0])

    # Where each value is read: node users, plus the output slots (the loss in the last stage, a
    # parameter's gradient in the stage that holds the parameter).
    param_stage: dict[str, int] = {}
    for node, info in info_of.items():
        if info.kind == InputKind.PARAM:
            readers = {stage[u] for u in node.users if u in stage}
            if len(readers) > 1:
                raise ValueError(
                    f"parameter {info.name} is read by pipeline stages {sorted(readers)} (tied weights?); "
                    "a parameter must live in one stage. Untie it or move the split points so its users "
                    "share a stage"
                )
            param_stage[info.name] = readers.pop() if readers else 0
    slot_stage = []
    for value, info in zip(slots, captured.outputs):
        if info.kind == OutputKind.GRAD:
            slot_stage.append(param_stage[info.name])
        elif info.kind in _FORWARD_OUTPUTS:
            slot_stage.append(last)
        else:
            slot_stage.append(None)

    readers: dict[torch.fx.Node, set] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        for user in node.users:
            if user.op != "output":
                readers.setdefault(node, set()).add(stage[user])
    for value, s in zip(slots, slot_stage):
        if isinstance(value, torch.fx.Node) and s is not None:
            readers.setdefault(value, set()).add(s)

    replicable = _replicable(gm, phases, info_of)
    transfers: list[Transfer] = []
    for node, stages in readers.items():
        if node.op != "call_function" or node in replicable:
            continue
        src = stage[node]
        for dst in sorted(stages - {src}):
            forward = phases[node] == FORWARD
            if (dst < src) if forward else (dst > src):
                raise ValueError(
                    f"pipeline split: {_describe(node)} is computed in stage {src} "
                    f"({'forward' if forward else 'backward'}) but read by stage {dst}; values can only "
                    "flow to later stages in forward and to earlier stages in backward. Move the split "
                    "points to module boundaries that the data crosses in one direction"
                )
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise ValueError(f"pipeline split: {_describe(node)} crosses stages {src}->{dst} but is not a tensor")
            transfers.append(Transfer(node.name, src, dst, FORWARD if forward else BACKWARD,
                                      tuple(val.shape), val.dtype))
    return [_build_stage(gm, s, stage, replicable, info_of, slots, captured.outputs, slot_stage, transfers)
            for s in range(num_stages)]


def _replicable(gm: torch.fx.GraphModule, phases: dict, info_of: dict) -> set:
    """Forward values computed from buffers and constants alone (rotary tables, masks): every stage
    that reads one recomputes it rather than receiving it each micro-batch. Nothing random, no
    collective, no parameter (its gradient would be split) and no input feeds them."""
    replicable: set = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr" or (node.op == "placeholder" and info_of[node].kind == InputKind.BUFFER):
            replicable.add(node)
        elif (
            node.op == "call_function" and phases[node] == FORWARD and not node.is_impure()
            and getattr(node.target, "namespace", None) != "_c10d_functional"
            and not compat.is_random_op(node.target)
            and all(a in replicable for a in node.all_input_nodes)
        ):
            replicable.add(node)
    return {n for n in replicable if n.op == "call_function"}


def _build_stage(gm, s, stage, replicable, info_of, slots, out_infos, slot_stage, transfers) -> StageGraph:
    graph = torch.fx.Graph()
    env: dict = {}
    names = {n.name: n for n in gm.graph.nodes}
    recvs = [t for t in transfers if t.dst == s]
    sends = [t for t in transfers if t.src == s]
    mine = {n for n in gm.graph.nodes if n.op == "call_function" and stage[n] == s and n not in replicable}
    used = {a for n in mine for a in n.all_input_nodes}
    used |= {v for v, st in zip(slots, slot_stage) if isinstance(v, torch.fx.Node) and st == s}
    pending = [n for n in used if n in replicable]
    while pending:  # what this stage recomputes, and what that reads
        for a in pending.pop().all_input_nodes:
            if a not in used:
                used.add(a)
                if a in replicable:
                    pending.append(a)

    inputs: list[InputInfo] = []
    primal_i = tangent_i = 0

    def placeholder(kind: str, source: torch.fx.Node, info: InputInfo, tangent: bool):
        nonlocal primal_i, tangent_i
        if tangent:
            tangent_i += 1
            name = f"tangents_{tangent_i}"
        else:
            primal_i += 1
            name = f"primals_{primal_i}"
        node = graph.placeholder(name)
        node.meta = dict(source.meta)
        env[source] = node
        inputs.append(info)

    originals = [n for n in info_of if n in used]
    for node in originals:  # primals first: parameters, buffers, inputs
        if info_of[node].kind != InputKind.TANGENT:
            placeholder(info_of[node].kind, node, info_of[node], tangent=False)
    for t in recvs:
        if t.phase == FORWARD:
            placeholder(RECV_FWD, names[t.name], InputInfo(RECV_FWD, t.name, t.src), tangent=False)
    for node in originals:
        if info_of[node].kind == InputKind.TANGENT:
            placeholder("tangent", node, info_of[node], tangent=True)
    for t in recvs:
        if t.phase == BACKWARD:
            placeholder(RECV_BWD, names[t.name], InputInfo(RECV_BWD, t.name, t.src), tangent=True)

    for node in gm.graph.nodes:
        if node.op == "get_attr" and node in used:
            env[node] = graph.node_copy(node, lambda a: env[a])
            env[node].meta = node.meta
        elif node.op == "call_function" and (node in mine or (node in replicable and node in used)):
            env[node] = graph.node_copy(node, lambda a: env[a])
            env[node].meta = node.meta

    forward_out, outputs = [], []
    for value, info, st in zip(slots, out_infos, slot_stage):
        if info.kind in _FORWARD_OUTPUTS and st == s:
            forward_out.append(env[value] if isinstance(value, torch.fx.Node) else value)
            outputs.append(info)
    for t in sends:
        if t.phase == FORWARD:
            forward_out.append(env[names[t.name]])
            outputs.append(OutputInfo(SEND_FWD, t.name, t.dst))
    # One gradient slot per primal, as the partition and runtime expect.
    grad_of = {info.name: value for value, info in zip(slots, out_infos) if info.kind == OutputKind.GRAD}
    backward_out = []
    for info in inputs:
        if info.kind == InputKind.TANGENT or info.kind == RECV_BWD:
            continue
        value = grad_of.get(info.name) if info.kind == InputKind.PARAM else None
        backward_out.append(env[value] if isinstance(value, torch.fx.Node) else None)
        outputs.append(OutputInfo(OutputKind.GRAD, info.name, -1) if value is not None else OutputInfo(OutputKind.NONE, "", -1))
    for t in sends:
        if t.phase == BACKWARD:
            backward_out.append(env[names[t.name]])
            outputs.append(OutputInfo(SEND_BWD, t.name, t.dst))
    graph.output(tuple(forward_out + backward_out))
    stage_gm = compat.lazy_graph_module(gm, graph)  # code generated only if it runs
    return StageGraph(s, stage_gm, inputs, outputs, len(forward_out), sends, recvs)


@dataclasses.dataclass(frozen=True)
class _Chain:
    slot: int  # output slot of the gradient
    fqn: str
    start: torch.fx.Node  # the local gradient the reduction starts from
    nodes: frozenset  # the reduction's nodes (collectives, waits, pads, reshapes)


def _reduction_chains(gm: torch.fx.GraphModule, graph: StageGraph) -> list[_Chain]:
    """The reduction of each gradient slot that has one (module docstring), in slot order."""
    out = gm.graph.output_node()
    chains = []
    for i, (value, info) in enumerate(zip(out.args[0], graph.outputs)):
        if info.kind != OutputKind.GRAD or not isinstance(value, torch.fx.Node):
            continue
        nodes, starts, stack = set(), set(), [value]
        while stack:
            node = stack.pop()
            if node in nodes:
                continue
            if (node.op == "call_function" and node.meta.get(meta.GRAD_OF) == info.name
                    and meta.is_redistribute(node)):
                nodes.add(node)
                stack.extend(node.all_input_nodes)
            else:
                starts.add(node)
        if not any(n.target in COLLECTIVE_KINDS for n in nodes) or len(starts) != 1:
            continue  # nothing to defer (or not one value to defer it from: left as it is)
        if any(u not in nodes and u is not out for n in nodes for u in n.users):
            continue
        if sum(1 for a in out.args[0] if a is value) != 1:
            continue
        chains.append(_Chain(i, info.name, starts.pop(), frozenset(nodes)))
    return chains


def deferred_parameters(graph: StageGraph) -> tuple[str, ...]:
    """The parameters whose reduction this stage can defer to the step's last micro-batch."""
    return tuple(c.fqn for c in _reduction_chains(graph.gm, graph))


def gradient_variant(graph: StageGraph, gm: torch.fx.GraphModule, *, reduce: bool,
                     running_sums: bool) -> StageGraph:
    """``graph`` rewritten for one place in the step (module docstring). ``reduce=False``: the
    deferred reductions are removed and those slots return the local unreduced value.
    ``running_sums``: one ``grad_accum`` backward input per parameter gradient slot, the step's sum
    so far, added right after the value the slot's reduction starts from (the slot's value when it
    has none), so the slot returns (or reduces) the new sum. ``gm``: a copy of ``graph.gm`` to
    rewrite."""
    chains = {c.slot: c for c in _reduction_chains(gm, graph)}
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    tangents = sum(1 for p in placeholders if "tangents" in p.name)
    inputs = list(graph.inputs)
    last = placeholders[-1]
    out = gm.graph.output_node()
    slots = list(out.args[0])
    for i, (value, info) in enumerate(zip(slots, graph.outputs)):
        if info.kind != OutputKind.GRAD or not isinstance(value, torch.fx.Node):
            continue
        chain = chains.get(i)
        start = chain.start if chain is not None else value
        if not running_sums:
            if not reduce:
                slots[i] = start
            continue
        # A tangent by name: a backward input, which the forward program never takes.
        tangents += 1
        with gm.graph.inserting_after(last):
            pending = gm.graph.placeholder(f"tangents_{tangents}")
        pending.meta["val"] = start.meta["val"]
        last = pending
        inputs.append(InputInfo(GRAD_ACCUM, info.name, -1))
        # In place into the sum (as autograd accumulates into ``.grad``): an out-of-place add would
        # hold the old sum, the gradient and the new sum at once, one more of the largest
        # gradient (the embedding's) at the peak. ``pending + start`` rounds as ``start + pending``.
        with gm.graph.inserting_after(start if start.op != "placeholder" else last):
            total = gm.graph.call_function(torch.ops.aten.add_.Tensor, (pending, start))
        total.meta.update({"val": start.meta["val"], meta.ROLE: meta.ROLE_ACCUMULATE,
                           meta.SOURCE: start.meta.get(meta.SOURCE, start.name)})
        tag(total, BACKWARD)
        if chain is not None and reduce:
            for node in chain.nodes:
                node.replace_input_with(start, total)
        else:
            slots[i] = total
    out.args = (tuple(slots),)
    if not reduce:
        doomed = set().union(*(c.nodes for c in chains.values())) if chains else set()
        for node in reversed(list(gm.graph.nodes)):
            if node in doomed:
                gm.graph.erase_node(node)
    gm.recompile()
    return dataclasses.replace(graph, gm=gm, inputs=inputs)
