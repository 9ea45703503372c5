"""Every collective's input stays referenced by the compiled program until the collective's wait
(runtime/collective_inputs.py), as the backend really keeps it: the graph's liveness, which the
memory estimator reads, counts an in-flight input as live."""

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.tools.explain import compile_for_explain, fake_world
from hyper_parallel.models import LlamaConfig, LlamaForCausalLM
from hyper_parallel.runtime.collective_inputs import hold_collective_inputs, release_after_wait

c10d = torch.ops._c10d_functional


def _programs(plan, world=4, **options):
    with fake_world(world, 0):
        mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        with hp.init_empty_weights():
            model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=3, num_attention_heads=4,
                                                 num_key_value_heads=2, max_position_embeddings=64))
        ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
        pmodel = compile_for_explain(model, plan, mesh, (), {"input_ids": ids, "labels": ids}, **options)
    return pmodel.compiled_programs()


def _check_held(gm: torch.fx.GraphModule) -> int:
    """Each issued collective's tensor inputs are last used at or after its wait; returns how many
    collectives were checked."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    checked = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "namespace", None) != "_c10d_functional":
            continue
        if node.target is c10d.wait_tensor.default:
            continue
        waits = [u for u in node.users if u.target is c10d.wait_tensor.default]
        assert waits, f"{node.name} is never waited in this program"
        wait = waits[0]
        for value in node.all_input_nodes:
            last = max(order[u] for u in value.users)
            assert last > order[wait], (
                f"{value.name}, an input of {node.name}, is last used at node {last}, before the "
                f"collective's wait {wait.name} (node {order[wait]})")
            releases = [u for u in value.users if u.target is release_after_wait]
            assert releases and order[releases[0]] == order[wait] + 1, (node.name, value.name)
        checked += 1
    return checked


@pytest.mark.slow
def test_inputs_of_prefetched_fsdp_collectives_live_until_their_waits():
    """FSDP with prefetch and reduce-scatters in flight under bf16/fp32 mixed precision: the
    all-gathers' and reduce-scatters' inputs (bf16 shard casts, packed gradients) are released
    right after the waits, wherever the passes moved the waits."""
    policy = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    plan = {"fully_shard": hp.FullyShard(units=("model.layers.*", ""), mixed_precision=policy)}
    forward, backward = _programs(plan, prefetch_depth=2, reductions_in_flight=2)
    assert _check_held(forward) >= 4  # 4 units' all-gathers and the loss all-reduces
    assert _check_held(backward) >= 4  # the units' reduce-scatters (and re-gathers)
    # In flight means in flight: some wait is not right after its issue.
    nodes = list(backward.graph.nodes)
    gaps = [nodes.index(next(iter(n.users))) - nodes.index(n) for n in nodes
            if n.op == "call_function" and n.target is c10d.reduce_scatter_tensor.default]
    assert max(gaps) > 1, gaps


def test_data_parallel_buckets_are_held_too():
    forward, backward = _programs({}, reductions_in_flight=1)
    assert _check_held(backward) >= 1 and _check_held(forward) >= 1


def test_hold_is_idempotent_and_changes_no_value():
    def program(x):
        y = c10d.all_reduce.default(x * 2.0, "sum", "0")
        return c10d.wait_tensor.default(y) + 1.0

    gm = torch.fx.symbolic_trace(program)
    before = len(gm.graph.nodes)
    hold_collective_inputs(gm)
    after = len(gm.graph.nodes)
    hold_collective_inputs(gm)
    assert after == before + 1 and len(gm.graph.nodes) == after
    assert _check_held(gm) == 1
    assert release_after_wait(torch.ones(1)) is None
