"""bucketing: one fused all-gather per FSDP unit per use, one fused reduce-scatter per unit, and
DDP-style buckets for the gradient all-reduces of parameters FSDP does not own.

Lowering gives every FSDP parameter its own all-gather (forward, and again in backward when the
unit reshards) and every gradient its own reduce-scatter (plus an all-reduce over the replicate axis
for HSDP). This pass fuses them per unit through one flat buffer, the copy-in / copy-out layout of
FSDP: shards are flattened and concatenated, gathered once, and each parameter is a reshaped slice
of the result; gradients are laid out rank-major ([world, numel/world] per parameter, concatenated
along dim 1), reduce-scattered once, and split back.

Reads: ``hp_fsdp_param``/``hp_fsdp_phase``/``hp_role`` (all-gathers of unshard chains) and
``hp_grad_of`` (gradient redistributions) on nodes, ``ctx.fsdp`` (units, ``comm_fusion``).
Data-parallel (and tensor-parallel replicated) gradients are all-reduced per parameter by lowering,
which may leave those all-reduces at the end of backward; here consecutive gradients (in the order
backward computes them, per reduce op, group and dtype) share one all-reduce of at most
``ctx.gradient_bucket_bytes`` (25 MB by default, as DDP; the first bucket at most
``ctx.first_gradient_bucket_bytes``, 1 MiB by default, so the first reduction starts early; the
bucket size when the caller set ``bucket_cap_mb``, as DDP: options.gradient_bucket_sizes), issued right
after the last gradient of the bucket is computed and reduced in place on the packed buffer. A
gradient alone in its bucket keeps its own all-reduce, moved right after the gradient. Before a
reduction is fused, the local re-layout lowering put between a gradient and its collective (a
dim-1 shard's split and cat, an uneven shard's padding), emitted at the graph's output, is moved
next to the gradient, so the fused reduction is not held until the end of backward.
Under mixed precision each gradient reaches its reduction through a cast to the reduce dtype; the
fused reduction packs the gradients in their own dtype and casts the packed buffer once (the same
elements), so no reduce-dtype copy of each gradient is alive beside the packed buffer. Under
``codegen="inductor"`` too: there a kernel that made a gradient and its cast would store the fp32
value it computed, where the single device (and FSDP2) rounds the gradient to the parameter dtype
before casting; packing first keeps that rounding, and the fp32 copies cost 1.23x the eager peak
of a bf16 FSDP step's program (docs/benchmarks.md, FSDP under Inductor).

A fused collective reads every member's input and feeds every member's users, so fusing is only
sound when no member's input depends (through any path, fused collectives of this pass included) on
another member's output. A bucket that would break this (e.g. GPT-2's column-parallel ``Conv1D``
under FSDP x TP: one gradient is reduce-scattered over ``dp`` then ``tp``, another of the same unit
over ``tp`` then ``dp``, so once the unit's ``dp`` bucket is fused its ``tp`` members straddle it) is
cut into parts in graph order, each fused on its own; see :func:`_acyclic_parts`.

Writes: fused collectives with ``meta["hp_bucket"] = "<unit> <phase> <kind> (<n> params)"`` (with
``", part <k>/<parts>"`` inside the parentheses when a bucket had to be cut; a lone data-parallel
all-reduce gets the label too, so the prefetch pass schedules its wait); each parameter's slice
of a fused all-gather keeps ``hp_fsdp_param``/``hp_fsdp_unit``; the per-parameter collectives are
removed; the graph is left in a (stable) topological order. FSDP fusion is skipped when
``comm_fusion=False``. Idempotent (a fused collective is never a candidate again); numerics
unchanged (same elements, same reductions).
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch

from .. import compat
from ..ir import meta
from ..ir.phase import BACKWARD, PARTITIONER_TAG, gather_phase, tag_value
from ..propagation import recompile

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _fake(like: torch.Tensor, shape, dtype=None) -> torch.Tensor:
    mode = getattr(like, "fake_mode", None)
    # Lowering traces the local graph under a fake mode, so every value is a fake tensor.
    assert mode is not None, (
        f"bucketing needs fake-tensor metadata on the local graph, got a {type(like).__name__} value"
    )
    return compat.fake_empty(like, shape, dtype)


class _Builder:
    """Emit nodes before an anchor, giving each a fake ``val`` and the bucket's meta."""

    def __init__(self, graph: torch.fx.Graph, anchor: torch.fx.Node, annotations: dict):
        self.graph, self.anchor, self.annotations = graph, anchor, annotations

    def __call__(self, target, args, val, kwargs=None) -> torch.fx.Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        node.meta.update(self.annotations)
        node.meta["val"] = val
        return node


def _single_wait(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    if len(users) == 1 and users[0].target is c10d.wait_tensor.default:
        return users[0]
    return None


def _unit_of_grad(node, fsdp) -> str | None:
    param = node.meta.get(meta.GRAD_OF)
    return fsdp.unit_of.get(param) if param else None


def _buckets(graph, fsdp):
    all_gathers, reduce_scatters, all_reduces = defaultdict(list), defaultdict(list), defaultdict(list)
    for node in graph.nodes:
        if node.op != "call_function" or meta.BUCKET in node.meta or _single_wait(node) is None:
            continue
        if node.target is c10d.all_gather_into_tensor.default and node.meta.get(meta.FSDP_PARAM):
            phase = gather_phase(node)
            _, size, group = node.args
            key = (node.meta[meta.FSDP_UNIT], phase, size, group, node.meta["val"].dtype)
            all_gathers[key].append(node)
        elif node.target is c10d.reduce_scatter_tensor.default and _unit_of_grad(node, fsdp) is not None:
            _, op, size, group = node.args
            key = (_unit_of_grad(node, fsdp), op, size, group, node.meta["val"].dtype)
            reduce_scatters[key].append(node)
        elif node.target is c10d.all_reduce.default and _unit_of_grad(node, fsdp) is not None:
            _, op, group = node.args
            key = (_unit_of_grad(node, fsdp), op, group, node.meta["val"].dtype)
            all_reduces[key].append(node)
    return all_gathers, reduce_scatters, all_reduces


def _position(graph):
    return {n: i for i, n in enumerate(graph.nodes)}

# Where a node is relative to another: fx keeps an order key on every node, updated as nodes are
# inserted and moved, so ``a < b`` (a before b in the graph) needs no {node: index} map rebuilt per
# fused bucket, which made the pass quadratic in the graph's size.


def _hoistable(node, anchor, seen) -> bool:
    """Whether ``node`` is available at ``anchor`` or can be recomputed there by copying pure ops
    (no collective, no random op, nothing impure: copying those would change what runs)."""
    if node.op == "placeholder" or node < anchor or node in seen:
        return True
    if (node.op != "call_function" or node.is_impure() or compat.is_random_op(node.target)
            or getattr(node.target, "namespace", None) == "_c10d_functional"):
        return False
    seen.add(node)
    return all(_hoistable(arg, anchor, seen) for arg in node.all_input_nodes)


def _hoist(graph, node, anchor, memo):
    """``node`` if it is available at ``anchor``; else a copy there of the pure ops computing it
    (the caller checked :func:`_hoistable`; in practice a cast or view of a parameter shard)."""
    if node.op == "placeholder" or node < anchor:
        return node
    if node not in memo:
        for arg in node.all_input_nodes:
            _hoist(graph, arg, anchor, memo)
        with graph.inserting_before(anchor):
            memo[node] = graph.node_copy(node, lambda a: memo.get(a, a))
    return memo[node]


def _erase(graph, members, waits) -> None:
    # Only after every fused node exists: a member may be the anchor new nodes are inserted before.
    for member, wait in zip(members, waits):
        graph.erase_node(wait)
        graph.erase_node(member)


def _fuse_all_gather(graph, members, label):
    waits = [_single_wait(m) for m in members]
    first_use = min(u for w in waits for u in w.users)
    seen: set = set()
    if not all(_hoistable(m.args[0], first_use, seen) for m in members):
        # An input only exists after the first use (and cannot be copied earlier): gather after the
        # last input instead; the final topological sort moves the earlier uses after the gather.
        first_use = max(m.args[0] for m in members).next
    memo: dict = {}
    inputs = [_hoist(graph, m.args[0], first_use, memo) for m in members]
    _, size, group = members[0].args
    sample = members[0].meta["val"]
    emit = _Builder(graph, first_use, {meta.BUCKET: label, meta.ROLE: meta.ROLE_REDISTRIBUTE,
                                       meta.FSDP_UNIT: members[0].meta[meta.FSDP_UNIT],
                                       **({meta.FSDP_PHASE: BACKWARD} if "backward" in label else {})})
    if "backward" in label:
        emit.annotations[PARTITIONER_TAG] = tag_value(BACKWARD)
    numels = [m.args[0].meta["val"].numel() for m in members]
    total = sum(numels)
    flats = [emit(aten.reshape.default, (x, [-1]), _fake(sample, [n])) for x, n in zip(inputs, numels)]
    flat = emit(aten.cat.default, (flats,), _fake(sample, [total]))
    gathered = emit(c10d.all_gather_into_tensor.default, (flat, size, group), _fake(sample, [size * total]))
    waited = emit(c10d.wait_tensor.default, (gathered,), _fake(sample, [size * total]))
    # The copy-out of the gathered rows stays op by op (``hp_pack``), right after the wait, as in
    # eager: each parameter is copied out and the gathered buffer freed before the unit computes.
    # In an Inductor region each copy would be made where its parameter is first read, holding the
    # whole buffer beside the unit's activations until its last parameter (the last unit of a
    # phase, whose copy-out no next gather separates from its compute: 1.08x the eager peak of
    # an FSDP step without resharding after forward).
    unpack = _Builder(graph, first_use, {**emit.annotations, meta.PACK: True})
    rows = unpack(aten.view.default, (waited, [size, total]), _fake(sample, [size, total]))
    parts = unpack(aten.split_with_sizes.default, (rows, numels, 1), [_fake(sample, [size, n]) for n in numels])
    for i, (member, wait) in enumerate(zip(members, waits)):
        part = unpack(operator.getitem, (parts, i), _fake(sample, [size, numels[i]]))
        shape = list(wait.meta["val"].shape)
        out = unpack(aten.reshape.default, (part, shape), _fake(sample, shape))
        if shape[0] == size and len(members) > 1:
            # One row per rank: the reshape is a strided view into the gathered rows, where the
            # per-parameter gather gave a contiguous tensor, and a later ``view`` (a dim-1 shard's
            # re-layout) needs one.
            out = unpack(aten.clone.default, (out,), _fake(sample, shape))
            out.kwargs = {"memory_format": torch.contiguous_format}
        out.meta[meta.FSDP_PARAM] = member.meta[meta.FSDP_PARAM]
        out.meta[meta.FSDP_UNIT] = member.meta[meta.FSDP_UNIT]
        wait.replace_all_uses_with(out)
    _erase(graph, members, waits)


def _relayout_early(graph, members) -> None:
    """Move the local re-layout lowering put before each member's reduction (a dim-1 shard's
    parts put first (compile/moves.py), a pad: pure ops, role "redistribute", no collective) and the add of a gradient kept by
    earlier accumulation micro-steps (role "accumulate", propagation/accumulation.py) from where
    lowering emitted them, the graph's output at the end of backward, to right after the values
    they read, so the reduction can follow the gradient instead of waiting for the end of backward."""
    for member in members:
        chain: set = set()
        stack = [member.args[0]]
        while stack:
            node = stack.pop()
            moves = meta.is_redistribute(node) or node.meta.get(meta.ROLE) == meta.ROLE_ACCUMULATE
            if (node in chain or node.op != "call_function" or not moves
                    or node.is_impure() or getattr(node.target, "namespace", None) == "_c10d_functional"):
                continue
            chain.add(node)
            stack.extend(node.all_input_nodes)
        outside = [i for n in chain for i in n.all_input_nodes if i not in chain]
        if not outside:
            continue
        # The chain keeps its own (topological) order and lands after its latest outside input
        # (fx nodes compare by graph position, kept current as nodes move).
        cursor = max(outside)
        for node in sorted(chain):
            cursor.append(node)
            cursor = node


def _fuse_reduction(graph, members, label, phase: str = BACKWARD):
    """Fuse reduce-scatters (or all-reduces) of one unit or bucket: issued after the last gradient
    they read. An all-reduce reduces its packed buffer in place (``all_reduce_``), so a bucket is
    held once, not as a packed copy plus an out-of-place result, and each gradient is a view of it
    (as DDP's ``gradient_as_bucket_view``)."""
    _relayout_early(graph, members)
    waits = [_single_wait(m) for m in members]
    scatter = members[0].target is c10d.reduce_scatter_tensor.default
    op, *rest = members[0].args[1:]
    size = rest[0] if scatter else 1
    sample = members[0].meta["val"]
    # Gradients cast to the reduce dtype (mixed precision) are packed in their own dtype and the
    # packed buffer cast once: the same values (a cast is elementwise), without every gradient's
    # reduce-dtype copy alive beside the packed buffer (for bf16 -> fp32, 2 bytes per element of
    # the bucket less at its peak than packing the fp32 copies).
    casts = _reduce_dtype_casts(members)
    sources = [c.args[0] for c in casts] if casts else [m.args[0] for m in members]
    packed_dtype = sources[0].meta["val"].dtype
    anchor = max(sources).next
    emit = _Builder(graph, anchor, {meta.BUCKET: label, meta.ROLE: meta.ROLE_REDISTRIBUTE,
                                   PARTITIONER_TAG: tag_value(phase)})
    # Reduce-scatter: each gradient as [world, numel/world] rows, concatenated along dim 1, so rank
    # r's slice of the flat buffer is every gradient's r-th shard. All-reduce: just concatenated.
    cols = [m.args[0].meta["val"].numel() // size for m in members]
    total = sum(cols)
    blocks = [emit(aten.reshape.default, (src, [size, c]), _fake(sample, [size, c], packed_dtype))
              for src, c in zip(sources, cols)]
    packed = emit(aten.cat.default, (blocks, 1), _fake(sample, [size, total], packed_dtype))
    packed.meta[meta.PACK] = True
    flat = emit(aten.reshape.default, (packed, [-1]), _fake(sample, [size * total], packed_dtype))
    if casts:
        flat = emit(aten._to_copy.default, (flat,), _fake(sample, [size * total]), dict(casts[0].kwargs))
    if scatter:
        reduced = emit(members[0].target, (flat, op, *rest), _fake(sample, [total]))
    else:  # the packed buffer is this bucket's own: reduce it in place
        reduced = emit(c10d.all_reduce_.default, (flat, op, *rest), flat.meta["val"])
    waited = emit(c10d.wait_tensor.default, (reduced,), reduced.meta["val"])
    parts = emit(aten.split_with_sizes.default, (waited, cols), [_fake(sample, [c]) for c in cols])
    for i, (member, wait) in enumerate(zip(members, waits)):
        part = emit(operator.getitem, (parts, i), _fake(sample, [cols[i]]))
        shape = list(wait.meta["val"].shape)
        out = emit(aten.reshape.default, (part, shape), _fake(sample, shape))
        if meta.GRAD_OF in member.meta:
            out.meta[meta.GRAD_OF] = member.meta[meta.GRAD_OF]
        wait.replace_all_uses_with(out)
    _erase(graph, members, waits)
    for c in casts:
        graph.erase_node(c)


def _reduce_dtype_casts(members) -> list[torch.fx.Node]:
    """Each member's input when every one is a plain dtype cast (``_to_copy`` with only ``dtype``)
    from one dtype to the reduction's, read by that member alone; else []."""
    casts = [m.args[0] for m in members]
    if not all(c.op == "call_function" and c.target is aten._to_copy.default and set(c.kwargs) == {"dtype"}
               and len(c.users) == 1 and isinstance(c.args[0], torch.fx.Node) for c in casts):
        return []
    dtypes = {(c.args[0].meta["val"].dtype, c.kwargs["dtype"]) for c in casts}
    return casts if len(dtypes) == 1 else []


def _issue_alone(graph, members, label):
    """A bucket of one gradient keeps its own all-reduce (no copy into a buffer, as DDP), issued
    right after the gradient it reads, where lowering may have left it at the end of backward; its
    wait follows it (the prefetch pass sinks it)."""
    (member,) = members
    wait = _single_wait(member)
    source = member.args[0]
    if source < member:
        source.append(member)
        member.append(wait)
    for node in (member, wait):
        node.meta[meta.BUCKET] = label


def _topological_order(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The graph's nodes in a stable topological order: the existing order, except that a node that
    precedes one of its inputs (a per-parameter copy-out, e.g. the unpadding slice of an uneven
    shard, that ran right after its own collective) moves to just after the inputs it needs.
    Raises the ValueError of :func:`_cycle_error` if there is no such order."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    placed: set = set()
    order: list = []
    waiting: dict = {}

    def place(node):
        # Depth-first over the nodes that waited on ``node`` (an explicit stack: chains of waiting
        # nodes can be longer than Python's recursion limit).
        stack = [node]
        while stack:
            current = stack.pop()
            missing = [a for a in current.all_input_nodes if a not in placed]
            if missing:
                waiting.setdefault(missing[0], []).append(current)
                continue
            order.append(current)
            placed.add(current)
            stack.extend(sorted(waiting.pop(current, ()), key=position.__getitem__, reverse=True))

    for node in nodes:
        place(node)
    if len(order) != len(nodes):
        raise _cycle_error([n for n in nodes if n not in placed], placed)
    return order


def _cycle_error(unplaced: list[torch.fx.Node], placed: set) -> ValueError:
    """The error for a graph bucketing made cyclic, naming the buckets, parameters and nodes of one
    cycle. Unreachable while :func:`_acyclic_parts` holds; it says what to do if it ever is not."""
    # Every unplaced node waits on an unplaced input, so following those inputs must come back to a
    # node already seen: that loop is a cycle (listed in data-flow order, from its earliest node).
    path: list = []
    seen: dict = {}
    node = unplaced[0]
    while node not in seen:
        seen[node] = len(path)
        path.append(node)
        node = next(a for a in node.all_input_nodes if a not in placed)
    cycle = path[seen[node]:][::-1]
    position = {n: i for i, n in enumerate(unplaced)}
    start = min(range(len(cycle)), key=lambda i: position[cycle[i]])
    cycle = cycle[start:] + cycle[:start]
    buckets = sorted({n.meta[meta.BUCKET] for n in cycle if meta.BUCKET in n.meta})
    params = sorted({p for n in cycle for p in (n.meta.get(meta.FSDP_PARAM), n.meta.get(meta.GRAD_OF)) if p})
    shown = " -> ".join(n.name for n in cycle[:16]) + (f" -> ... ({len(cycle)} nodes)" if len(cycle) > 16 else "")
    return ValueError(
        f"bucketing produced a cycle (a bug in hyper_parallel's bucketing pass): the fused collectives "
        f"{buckets or '(none)'} of parameters {params or '(none)'} depend on each other through "
        f"{shown} -> {cycle[0].name}. Work around it with parallelize(..., disable_passes=['bucketing']) "
        "(collectives stay per parameter; numerics are unchanged) and please report it with the "
        "model, plan and mesh (dump_dir= writes the graph before this pass)."
    )


def _restore_topological_order(graph: torch.fx.Graph) -> None:
    """Relink the graph in :func:`_topological_order` (nodes already in order do not move)."""
    order = _topological_order(graph)
    previous = order[0]
    for node in order[1:]:
        if previous.next is not node:
            previous.append(node)
        previous = node


def _acyclic_parts(graph: torch.fx.Graph, buckets: list[list[torch.fx.Node]]) -> list[list[list[torch.fx.Node]]]:
    """Cut each bucket (collectives in graph order, fused in the order given) into parts that can
    each become one fused collective while the graph stays acyclic; a bucket that can is one part.

    Fusing a part contracts its collectives into one node: every member's output then depends on
    every member's input. The contracted graph is acyclic iff no member's input depends, through
    any path, on another member's output, where paths run through the parts already formed (of
    this call, as they will be fused). So for each collective we keep the set of collectives (a
    bitmask) whose outputs its input depends on: first through the graph as it stands, then updated
    as parts merge. A collective joins the first part of its bucket it is independent of, both
    ways, else starts a new one. E.g. a unit's ``dp`` reduce-scatters fused as one part make a
    gradient reduced ``dp`` then ``tp`` depend, through that part, on another reduced ``tp`` then
    ``dp``: their ``tp`` reduce-scatters land in two parts."""
    members = [m for bucket in buckets for m in bucket]
    index = {m: i for i, m in enumerate(members)}
    ancestors = [0] * len(members)  # bit j of ancestors[i]: member i's input depends on member j
    reach: dict = {}  # node -> the members whose outputs it depends on (or is)
    for node in _topological_order(graph):
        mask = 0
        for arg in node.all_input_nodes:
            mask |= reach.get(arg, 0)
        i = index.get(node)
        if i is not None:
            ancestors[i] = mask
            mask |= 1 << i
        if mask:
            reach[node] = mask
    del reach

    def merge(part: list[int]) -> None:
        # The part becomes one node: it depends on what any member depended on, and whatever
        # depended on one member now depends on all of them and on their ancestors.
        bits = sum(1 << i for i in part)
        shared = 0
        for i in part:
            shared |= ancestors[i]
        for j, mask in enumerate(ancestors):
            if mask & bits:
                ancestors[j] = mask | shared | bits
        for i in part:
            ancestors[i] = shared

    result = []
    for bucket in buckets:
        ids = [index[m] for m in bucket]
        bits = sum(1 << i for i in ids)
        if not any(ancestors[i] & bits for i in ids):  # the common case: the bucket fuses whole
            merge(ids)
            result.append([bucket])
            continue
        parts: list[list[int]] = []
        for i in ids:
            for part in parts:
                # Members of a part share their ancestors (merge), so one stands for all.
                if not ancestors[i] & sum(1 << j for j in part) and not ancestors[part[0]] >> i & 1:
                    part.append(i)
                    merge(part)
                    break
            else:
                parts.append([i])
        result.append([[members[i] for i in part] for part in parts])
    return result


def _fuse_buckets(graph: torch.fx.Graph, buckets: list[tuple[str, list[torch.fx.Node]]], fuse,
                  alone=None) -> bool:
    """Fuse each ``(name, collectives)`` bucket with ``fuse``, in parts (:func:`_acyclic_parts`),
    labelled ``"<name> (<n> params)"`` (``", part <k>/<parts>"`` added when cut). With ``alone``,
    parts of one collective go to it instead of ``fuse``. Whether the graph changed."""
    changed = False
    for (name, _), parts in zip(buckets, _acyclic_parts(graph, [members for _, members in buckets]) if buckets else ()):
        for k, part in enumerate(parts, 1):
            where = f", part {k}/{len(parts)}" if len(parts) > 1 else ""
            (alone if alone is not None and len(part) == 1 else fuse)(graph, part, f"{name} ({len(part)} params{where})")
            changed = True
    return changed


def _gradient_all_reduce_buckets(graph, fsdp, cap_bytes: int, first_cap_bytes: int) -> list[list[torch.fx.Node]]:
    """The all-reduces of gradients not owned by FSDP (data parallelism, and parameters replicated
    under tensor parallelism), in the order backward produces the gradients (lowering may have put
    the all-reduces themselves at the end of backward), cut into DDP's gradient buckets per (reduce
    op, group, dtype): the first at most ``first_cap_bytes`` (DDP's 1 MiB first bucket, so the first
    reduction starts early in backward), the others at most ``cap_bytes``."""
    candidates = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not c10d.all_reduce.default or meta.BUCKET in node.meta:
            continue
        param = node.meta.get(meta.GRAD_OF)
        if param and (fsdp is None or param not in fsdp.unit_of) and _single_wait(node) is not None:
            candidates.append(node)
    # What lowering emitted at the output between a gradient and its all-reduce (a re-layout, the
    # add of an accumulated gradient) moves next to the gradient first, so the order is backward's.
    _relayout_early(graph, candidates)
    order = _position(graph)
    candidates.sort(key=lambda n: order[n.args[0]])
    buckets: list[list[torch.fx.Node]] = []
    current: dict[tuple, tuple[list, int, int]] = {}  # key -> (open bucket, its bytes, its cap)
    for node in candidates:
        _, op, group = node.args
        val = node.meta["val"]
        key, nbytes = (op, group, val.dtype), val.numel() * val.element_size()
        members, size, cap = current.get(key, (None, 0, min(first_cap_bytes, cap_bytes)))
        if members is None or size + nbytes > cap:
            if members is not None:
                cap = cap_bytes
            members, size = [], 0
            buckets.append(members)
        members.append(node)
        current[key] = (members, size + nbytes, cap)
    return buckets


def bucketing_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    fsdp = ctx.fsdp
    graph = gm.graph
    changed = False
    if fsdp is not None and fsdp.comm_fusion:
        all_gathers, reduce_scatters, _ = _buckets(graph, fsdp)
        changed |= _fuse_buckets(graph, [(f"{unit or '<root>'} {phase} all_gather", members)
                                         for (unit, phase, *_), members in all_gathers.items()], _fuse_all_gather)
        changed |= _fuse_buckets(graph, [(f"{unit or '<root>'} reduce_scatter", members)
                                         for (unit, *_), members in reduce_scatters.items()], _fuse_reduction)
        # HSDP: the replicate-axis all-reduces consume the fused reduce-scatter's outputs.
        changed |= _fuse_buckets(graph, [(f"{unit or '<root>'} all_reduce", members)
                                         for (unit, *_), members in _buckets(graph, fsdp)[2].items()], _fuse_reduction)
    # As DDP, a gradient alone in its bucket keeps its own all-reduce (also a part cut to one).
    buckets = _gradient_all_reduce_buckets(graph, fsdp, ctx.gradient_bucket_bytes, ctx.first_gradient_bucket_bytes)
    changed |= _fuse_buckets(graph, [(f"gradient bucket {i} all_reduce", members) for i, members in enumerate(buckets)],
                             _fuse_reduction, alone=_issue_alone)
    if not changed:  # nothing to fuse: the graph is as it came (ordered, no dead code)
        return gm
    _restore_topological_order(graph)
    graph.eliminate_dead_code()
    graph.lint()
    recompile(gm)
    return gm
