"""reshard_after_forward: gather FSDP parameters again in backward instead of keeping them.

Without this pass the partitioner saves every all-gathered parameter (and views of it, such as the
transposed weight a matmul's backward uses) from forward to backward: FSDP with
``reshard_after_forward=False``. For units that reshard, every backward use of an all-gathered
parameter, or of a cheap view of it computed in forward, is rewired to a copy of that chain made in
the backward region, right before its first backward use; the forward copy then dies after its
last forward use and only the shard (a graph input) crosses to backward. The chain starts at the
shard: under mixed precision its cast to ``param_dtype`` before the all-gather is copied too. On a
shard axis of one rank there is no all-gather and that cast is the whole chain: backward casts the
parameter again instead of keeping its ``param_dtype`` copy from forward (as FSDP2 frees it).

``reshard_after_forward=<k>`` (FSDP2's "world size to reshard to", 1 < k < N for a shard axis of N
ranks): each rank keeps 1/k of the gathered parameter instead of 1/N, and backward gathers over a
group of k ranks (contiguous along the shard axis, e.g. one node) instead of all N. Right after the
forward all-gather's wait, the rank at position p of its k-group keeps rows [p, p+1) * rows(w)/k of
the gathered result w (a clone, so w itself can die); the backward copy of the all-gather gathers
those pieces over the k-group. ``all_gather_into_tensor`` concatenates on dim 0 and every rank
holds the same w, so the k pieces concatenate to w exactly: numerics are bit-identical to
``reshard_after_forward=True``. ``attach_post_forward_groups`` (fsdp/resolve.py) creates the k-groups
(at ``parallelize`` time, since creating a process group is collective).

Reads: ``hp_fsdp_param``/``hp_fsdp_unit``/``hp_role`` (lowering), ``hp_fsdp_cast`` (the
mixed-precision casts, propagation/unshard.py) and ``partitioner_tag`` on nodes,
``ctx.fsdp`` (units, their reshard flags and ``post_forward_group``/``post_forward_rank``),
``ctx.mesh`` (the shard axis's group). Writes: copied nodes with ``meta["hp_fsdp_phase"] =
"backward"``; for int units, the kept piece (forward ``slice`` + ``clone``, ``meta["hp_fsdp_post_forward"]
= k``, ``partitioner_tag="is_forward"``) and the backward all-gather over the k-group, which keeps
the original's ``hp_fsdp_param``/``hp_fsdp_unit``/``hp_role`` so bucketing fuses a unit's backward
gathers into one. Idempotent (backward uses already point at copies; kept pieces are never
recomputed); numerics unchanged (the copies compute the same values).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import compat
from ..ir import meta
from ..fsdp.plan import post_forward_size
from ..ir.phase import BACKWARD, FORWARD, PARTITIONER_TAG, is_tagged_backward, tag, tag_value
from ..propagation import recompile

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

POST_FORWARD = meta.FSDP_POST_FORWARD

# Ops that only re-view or re-type a gathered parameter: recomputing them in backward is free next
# to keeping their unsharded result alive.
_CHEAP = {
    aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default,
    aten._unsafe_view.default, aten.reshape.default, aten.expand.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.clone.default, aten._to_copy.default, aten.alias.default,
    aten.slice.Tensor, aten.select.int, aten.split_with_sizes.default, aten.cat.default,
    aten.contiguous.default,
}


def gathered_param_region(graph: torch.fx.Graph, params=None) -> set[torch.fx.Node]:
    """Forward nodes holding an all-gathered FSDP parameter (of ``params``, default all) or a cheap
    view of one: what keeping a parameter unsharded between forward and backward costs.

    The mixed-precision cast of a shard counts as well: before an all-gather it is the shard-sized
    input the gather reads, and on a shard axis of one rank (no all-gather at all) it *is* the
    unsharded parameter in ``param_dtype``, which FSDP frees after forward like any gathered one."""
    region: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if is_tagged_backward(node) or node.op != "call_function":
            continue
        param = node.meta.get(meta.FSDP_PARAM)
        cast = node.meta.get(meta.FSDP_CAST)
        if param is not None and (params is None or param in params) and meta.is_redistribute(node):
            region.add(node)
        elif cast is not None and (params is None or cast in params) and node.target is aten._to_copy.default:
            region.add(node)
        elif node.target in _CHEAP and any(a in region for a in node.all_input_nodes):
            if all(a in region or a.op == "placeholder" for a in node.all_input_nodes):
                region.add(node)
    return region


def _shard_preparation(region: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The forward nodes that prepare a shard for a region all-gather from graph inputs only, with
    cheap ops: the cast of the fp32 shard to ``param_dtype`` under mixed precision (and a view or
    pad of it). Copied into backward with the gather, so backward reads the shard itself, not a
    forward ``param_dtype`` copy of it that would otherwise be saved for every resharded unit."""
    out: set[torch.fx.Node] = set()

    def prepares(node: torch.fx.Node) -> bool:
        if node.op == "placeholder" or node in out:
            return True
        if node.op != "call_function" or node.target not in _CHEAP or is_tagged_backward(node):
            return False
        if all(prepares(a) for a in node.all_input_nodes):
            out.add(node)
            return True
        return False

    for node in region:
        if node.target is c10d.all_gather_into_tensor.default:
            prepares(node.args[0])
    return out


@dataclasses.dataclass(frozen=True)
class _Smaller:
    """Where a unit's backward all-gather runs instead of the shard axis."""

    k: int
    group: str
    position: int
    shard_size: int
    shard_group: str


def _smaller_groups(fsdp, mesh) -> dict[str, _Smaller]:
    out = {}
    for u in fsdp.units:
        k = post_forward_size(u)
        if k is None:
            continue
        assert u.post_forward_group is not None, (
            f"FSDP unit {u.module_fqn!r} reshards to {k} ranks but has no post-forward group: "
            "attach_post_forward_groups was not called"
        )
        axis = mesh.mesh_dim_names.index(fsdp.shard_axis)
        out[u.module_fqn] = _Smaller(
            k, u.post_forward_group, u.post_forward_rank, mesh.size(axis), mesh.get_group(axis).group_name
        )
    return out


def _fake(like: torch.Tensor, shape) -> torch.Tensor:
    return compat.fake_empty(like, shape)


def _regather_kept_piece(graph, gather: torch.fx.Node, anchor: torch.fx.Node, to: _Smaller) -> torch.fx.Node:
    """Keep this rank's 1/k of ``gather``'s forward result; return an all-gather of the pieces
    over the k-group, inserted before ``anchor`` (it has the same value as ``gather``)."""
    wait = next(u for u in gather.users if u.target is c10d.wait_tensor.default)
    full = wait.meta["val"]
    rows = full.shape[0] // to.shard_size * (to.shard_size // to.k)
    lo = to.position * rows
    kept = []
    after = wait
    for target, args in ((aten.slice.Tensor, (wait, 0, lo, lo + rows)), (aten.clone.default, None)):
        with graph.inserting_after(after):
            node = graph.call_function(target, args or (after,))
        node.meta.update(wait.meta)
        node.meta.update({
            "val": _fake(full, [rows, *full.shape[1:]]), POST_FORWARD: to.k, PARTITIONER_TAG: tag_value(FORWARD),
            meta.REDISTRIBUTE: f"keep rows {lo}:{lo + rows} of {full.shape[0]} (reshard to {to.k} ranks)",
        })
        kept.append(node)
        after = node
    with graph.inserting_before(anchor):
        regather = graph.call_function(c10d.all_gather_into_tensor.default, (kept[-1], to.k, to.group))
    regather.meta.update(gather.meta)  # same value (and fake val) as the forward all-gather
    regather.meta.update({
        meta.FSDP_PHASE: BACKWARD, PARTITIONER_TAG: tag_value(BACKWARD),
        meta.REDISTRIBUTE: f"{gather.meta.get(meta.REDISTRIBUTE, '')} (over {to.k} ranks)".lstrip(),
    })
    return regather


def reshard_after_forward_pass(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    fsdp = ctx.fsdp
    if fsdp is None:
        return gm
    resharding = {p for u in fsdp.units if u.reshard_after_forward for p in u.params}
    graph = gm.graph
    # The forward region that may be recomputed: the all-gather chains of resharding parameters and
    # the cheap views computed from them in forward (not the pieces int units keep on purpose).
    region = {n for n in gathered_param_region(graph, resharding) if POST_FORWARD not in n.meta}
    if not region:
        return gm
    region |= _shard_preparation(region)
    smaller = _smaller_groups(fsdp, ctx.mesh)
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    copied: set[torch.fx.Node] = set()  # copies.values(), for the membership test below

    def copy_before(node: torch.fx.Node, anchor: torch.fx.Node) -> torch.fx.Node:
        if node not in region:
            return node
        if node not in copies:
            to = smaller.get(node.meta.get(meta.FSDP_UNIT))
            if (
                to is not None and node.target is c10d.all_gather_into_tensor.default
                and tuple(node.args[1:]) == (to.shard_size, to.shard_group)
            ):
                copies[node] = _regather_kept_piece(graph, node, anchor, to)
                copied.add(copies[node])
                return copies[node]
            for arg in node.all_input_nodes:
                copy_before(arg, anchor)
            with graph.inserting_before(anchor):
                new = graph.node_copy(node, lambda a: copies.get(a, a))
            new.meta[meta.FSDP_PHASE] = BACKWARD
            tag(new, BACKWARD)
            copies[node] = new
            copied.add(new)
        return copies[node]

    for user in list(graph.nodes):
        # The output node counts as a backward use: a gathered parameter it returns is one kept
        # after backward (set_reshard_after_backward(False)), which must not be kept from forward.
        if not (is_tagged_backward(user) or user.op == "output") or user in copied:
            continue
        for arg in list(user.all_input_nodes):
            if arg in region:
                user.replace_input_with(arg, copy_before(arg, user))
    graph.lint()
    recompile(gm)
    return gm
