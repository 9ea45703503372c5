"""``split_points="auto"``: place the stage cuts with the cost model.

The candidate cuts are the blocks of the model's ``nn.ModuleList``s (decoder layers). The lowered
joint graph is split at *every* candidate (passes/pipeline_split.assign_stages) into segments:
segment 0 is what runs before the first block (embeddings), segment k is block k-1, and the last
block's segment also holds what follows it (final norm, head, loss), which always belongs to the
last stage. Each segment costs the roofline time of its forward and backward nodes on the mesh's
hardware profile (cost/compute.py), and holds its parameters, their gradients and the activations
it saves per micro-batch in flight.

Choosing S contiguous stages is a path in a DAG (networkx): node (i, k) = the first i segments
in k stages; an edge (i, k) -> (j, k+1) is a stage of segments i..j-1, weighted by its time, and
exists only if that stage fits the device memory. The split minimises the slowest stage (a
bottleneck path: the smallest weight threshold under which a path exists), ties broken by the
smallest total. Every rank computes the same choice from the same graph; rank 0's is broadcast so
a difference in floating-point sums cannot split the ranks.
"""

from __future__ import annotations

import networkx as nx
import torch
import torch.distributed as dist

from ..ir.kinds import InputKind
from ..cost import get_profile
from ..cost.compute import node_work, roofline_time, tensor_bytes
from ..analysis.debug import DEVICE_PROFILES
from ..errors import internal_error
from ..passes.pipeline_split import assign_stages
from ..recompute import repeated_blocks
from ..ir.phase import BACKWARD, FORWARD
from .plan import ResolvedPipeline
from .schedules import CustomSchedule, peak_in_flight


def segment_costs(gm: torch.fx.GraphModule, captured, blocks: tuple[str, ...], profile) -> tuple[list, list, list]:
    """Per segment (len(blocks) + 1): seconds of compute (forward + backward), bytes of parameters
    (counted twice: value and gradient), bytes of forward values backward reads (per micro-batch)."""
    segment, phases = assign_stages(gm, blocks)
    n = len(blocks) + 1
    seconds, param_bytes, saved_bytes = [0.0] * n, [0] * n, [0] * n
    for node, k in segment.items():
        seconds[k] += roofline_time(node_work(node), profile)
        if phases[node] == FORWARD and any(phases.get(u) == BACKWARD for u in node.users):
            saved_bytes[k] += tensor_bytes(node.meta.get("val"))
    for node, info in zip(gm.graph.find_nodes(op="placeholder"), captured.inputs):
        readers = [segment[u] for u in node.users if u in segment]
        if info.kind == InputKind.PARAM and readers:
            param_bytes[min(readers)] += 2 * tensor_bytes(node.meta.get("val"))
    return seconds, param_bytes, saved_bytes


def best_split(seconds: list[float], memory: list[int] | None, num_stages: int,
               memory_limit: float | None = None) -> tuple[list[int], float]:
    """Cut positions (segment indices where stages 1..S-1 begin) minimising the slowest stage, and
    that stage's time. ``memory[k]``: bytes a stage holding segment k needs; None = no limit."""
    n = len(seconds)
    if num_stages > n:
        raise ValueError(
            f"split_points='auto': {num_stages} stages need at least {num_stages} segments, but the model has "
            f"{n - 1} repeated blocks; use fewer stages or give split_points explicitly"
        )
    prefix = [0.0]
    for s in seconds:
        prefix.append(prefix[-1] + s)
    graph = nx.DiGraph()
    for k in range(num_stages):
        for i in range(n):
            for j in range(i + 1, n + 1):
                if (k == num_stages - 1) != (j == n):  # only the last stage reaches the end
                    continue
                if memory is not None and memory_limit is not None and sum(memory[i:j]) > memory_limit:
                    continue
                graph.add_edge((i, k), (j, k + 1), weight=prefix[j] - prefix[i])
    source, target = (0, 0), (n, num_stages)
    if source not in graph or target not in graph or not nx.has_path(graph, source, target):
        raise ValueError(
            f"split_points='auto': no split into {num_stages} stages fits the device memory "
            f"({memory_limit:,.0f} bytes per rank); shard more inside the stages (fully_shard, tensor "
            "parallelism), recompute, or use more stages"
        )
    for threshold in sorted({w for _, _, w in graph.edges(data="weight")}):
        sub = nx.DiGraph([(u, v, d) for u, v, d in graph.edges(data=True) if d["weight"] <= threshold])
        if source in sub and target in sub and nx.has_path(sub, source, target):
            path = nx.shortest_path(sub, source, target, weight="weight")
            return [i for i, _ in path[1:-1]], threshold
    # The largest threshold keeps every edge, so only a non-finite stage time (a cost-model bug) ends here.
    raise internal_error(
        "pipeline split_points='auto'", f"no cut into {num_stages} stages was found though one exists (stage "
        f"times {seconds} seconds per segment)",
        workaround="give PipelinePlan(split_points=[...]) explicitly",
    )


def choose_split_points(gm: torch.fx.GraphModule, captured, module, resolved: ResolvedPipeline,
                        state) -> tuple[tuple, dict]:
    blocks = repeated_blocks(module)
    if not blocks:
        raise ValueError(
            f"split_points='auto' cuts between repeated blocks (modules in an nn.ModuleList), and "
            f"{type(module).__name__} has none; give PipelinePlan(split_points=[...]) explicitly"
        )
    profile = get_profile(DEVICE_PROFILES.get(state.mesh.device_type, "h100"))
    seconds, param_bytes, saved_bytes = segment_costs(gm, captured, blocks, profile)
    plan = resolved.plan
    # Micro-batches in flight on the first stage (the most): all of them for GPipe, else one per
    # pipeline rank (1F1B's warm-up); a custom schedule's own peak.
    if isinstance(plan.schedule, CustomSchedule):
        in_flight = peak_in_flight(plan.rank_schedules(resolved.num_ranks))
    elif plan.schedule == "GPipe":
        in_flight = plan.num_microbatches
    else:
        in_flight = min(plan.num_microbatches, resolved.num_ranks)
    memory = [p + in_flight * a for p, a in zip(param_bytes, saved_bytes)]
    cuts, slowest = best_split(seconds, memory, resolved.num_stages, profile.memory_bytes * plan.stages_per_rank)
    split_points = [blocks[c - 1] for c in cuts]
    if dist.is_initialized() and dist.get_world_size() > 1:
        chosen = [split_points]
        dist.broadcast_object_list(chosen, src=0)
        split_points = chosen[0]
    report = {
        "profile": profile.name,
        "segment_seconds": seconds,
        "segment_bytes": memory,
        "chosen": split_points,
        "slowest_stage_seconds": slowest,
    }
    return tuple(split_points), report
