"""FSDP / HSDP as compiler passes: single-device parity (3 SGD steps, every gradient) and the exact
collective structure and volume of FSDP, read from the compile summary."""

import contextlib
import copy
import math

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.testing.parity import build_model, global_batch, run_parity
from hyper_parallel.testing.stepper import ParityStepper, batches, strided

LAYERS = 2  # build_model("llama")'s default depth
UNITS = LAYERS + 1  # model.layers.* and the root (embedding, final norm, lm_head)
PARAM_BYTES = 106_816 * 4  # the example Llama's parameters at 2 layers, fp32
EMBEDDING_BYTES = 256 * 64 * 4  # not needed by backward: never re-gathered there


def _coll(summary, direction, kind, axis):
    return summary["collectives"][direction].get(kind, {}).get(axis, {"count": 0, "bytes": 0})


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_parity_and_fused_collectives(dist2, dist4, world):
    pool = {2: dist2, 4: dist4}[world]
    summary = pool.run(run_parity, "llama", "fsdp", (world,), ("dp",))[0]["summary"]
    # Per unit per step: 1 fused all-gather forward, 1 again in backward (reshard), 1 reduce-scatter.
    fwd_ag, bwd_ag = _coll(summary, "forward", "all_gather", "dp"), _coll(summary, "backward", "all_gather", "dp")
    rs = _coll(summary, "backward", "reduce_scatter", "dp")
    assert (fwd_ag["count"], bwd_ag["count"], rs["count"]) == (UNITS, UNITS, UNITS)
    # Analytic FSDP volume (bytes of each rank's local collective input): every shard gathered in
    # forward, all but the embedding again in backward, every full gradient reduce-scattered.
    assert fwd_ag["bytes"] == PARAM_BYTES // world
    assert bwd_ag["bytes"] == (PARAM_BYTES - EMBEDDING_BYTES) // world
    assert rs["bytes"] == PARAM_BYTES
    # Resharding: no gathered parameter is kept from forward to backward.
    assert summary["saved_for_backward"]["gathered_param_bytes"] == 0


def test_fsdp_without_reshard_keeps_parameters_and_gathers_once(dist2):
    summary = dist2.run(run_parity, "llama", "fsdp_keep", (2,), ("dp",))[0]["summary"]
    assert _coll(summary, "forward", "all_gather", "dp")["count"] == UNITS
    assert _coll(summary, "backward", "all_gather", "dp")["count"] == 0
    # The unsharded parameters backward needs are kept: all but the embedding.
    assert summary["saved_for_backward"]["gathered_param_bytes"] == PARAM_BYTES - EMBEDDING_BYTES


def test_fsdp_without_comm_fusion_is_per_parameter(dist2):
    summary = dist2.run(run_parity, "llama", "fsdp_unfused", (2,), ("dp",))[0]["summary"]
    num_params = 9 * LAYERS + 3
    assert _coll(summary, "forward", "all_gather", "dp")["count"] == num_params
    assert _coll(summary, "backward", "all_gather", "dp")["count"] == num_params - 1  # not the embedding
    assert _coll(summary, "backward", "reduce_scatter", "dp")["count"] == num_params


def test_hsdp_2x2(dist4):
    summary = dist4.run(run_parity, "llama", "fsdp", (2, 2), ("dp_replicate", "dp_shard"))[0]["summary"]
    assert _coll(summary, "forward", "all_gather", "dp_shard")["count"] == UNITS
    assert _coll(summary, "backward", "reduce_scatter", "dp_shard")["count"] == UNITS
    # One fused all-reduce per unit over the replicate axis (cross-entropy's token count is reduced
    # in forward and reused by backward).
    replicate = _coll(summary, "backward", "all_reduce", "dp_replicate")
    assert replicate["count"] == UNITS
    assert replicate["bytes"] == PARAM_BYTES // 2


def test_fsdp_with_tensor_parallel_2x2(dist4):
    summary = dist4.run(run_parity, "llama", "fsdp_tp", (2, 2), ("dp", "tp"))[0]["summary"]
    fwd_ag = _coll(summary, "forward", "all_gather", "dp")
    assert fwd_ag["count"] == UNITS
    # Each rank gathers over dp the shards of its tensor-parallel piece: a quarter of every
    # TP-sharded parameter and half of the replicated norms.
    assert fwd_ag["bytes"] < PARAM_BYTES // 2
    assert _coll(summary, "backward", "reduce_scatter", "dp")["count"] == UNITS
    # Megatron, + the vocab-parallel loss (per-token max and exp-sum, the loss's partial sum).
    assert _coll(summary, "forward", "all_reduce", "tp")["count"] == 2 * LAYERS + 1 + 3


def test_fsdp_hf_llama(dist2):
    pytest.importorskip("transformers")
    summary = dist2.run(run_parity, "hf_llama", "fsdp", (2,), ("dp",))[0]["summary"]
    assert _coll(summary, "forward", "all_gather", "dp")["count"] == 2 + 1  # 2 layers + root
    assert summary["fallbacks"] == []


def test_fsdp_adamw_tracks_reference(dist2):
    results = dist2.run(run_parity, "llama", "fsdp", (2,), ("dp",), optimizer="adamw", loss_rtol=1e-4)
    assert len(results[0]["losses"]) == 3


def fsdp2_style_calls():
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    summaries = []
    for style in ("plan", "calls"):
        model = build_model("llama")
        if style == "plan":
            model = hp.parallelize(model, {"fully_shard": hp.FullyShard(units=("model.layers.*", ""))}, mesh)
        else:
            for layer in model.model.layers:
                hp.fully_shard(layer, mesh=mesh)
            hp.fully_shard(model, mesh=mesh)
            model = hp.parallelize(model, None, mesh)
        model(**global_batch("llama", 4, 16))["loss"].backward()
        summaries.append(model.compile_summary())
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    return summaries, placements


def test_fully_shard_calls_compile_like_the_plan(dist2):
    (plan_summary, calls_summary), placements = dist2.run(fsdp2_style_calls)[0]
    assert plan_summary["collectives"] == calls_summary["collectives"]
    assert plan_summary["spmd_hash"] == calls_summary["spmd_hash"]
    assert placements["model.layers.0.mlp.up_proj.weight"] == "(Shard(dim=0),)"


def mixed_precision_parity(steps=3, ignore_fraction=0.0):
    """bf16 compute / fp32 reduce vs one device doing the same casts: fp32 master weights, a bf16
    compute copy each step, gradients cast to fp32 before the SGD step."""
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    master = build_model("llama")
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = hp.parallelize(
        copy.deepcopy(master),
        {"fully_shard": hp.FullyShard(units=("model.layers.*", ""), mixed_precision=policy)}, mesh,
    )
    worst = {"loss": 0.0, "grad": 0.0}

    def track_worst(record):
        worst["loss"] = max(worst["loss"], abs(record.loss.item() - record.ref_loss.item()))
        device = dict(record.compute.named_parameters())
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32, name
            g, ref = p.grad.full_tensor(), device[name].grad.float()
            worst["grad"] = max(worst["grad"], (g - ref).abs().max().item())

    # assert_matches_bf16_reference each step (the loss, every gradient within the bf16 bound).
    ParityStepper(master, model, mesh=mesh, batch=batches(ignore_fraction=ignore_fraction), bf16_reference=True,
                  before_optimizer=track_worst).run(steps)
    return worst, model.compile_summary()


def test_fsdp_bf16_params_fp32_reduce(dist2):
    worst, summary = dist2.run(mixed_precision_parity)[0]
    # The all-gathers move bf16 (half the fp32 bytes); the reduce-scatters fp32 (reduce_dtype).
    assert _coll(summary, "forward", "all_gather", "dp")["bytes"] == PARAM_BYTES // 2 // 2
    assert _coll(summary, "backward", "reduce_scatter", "dp")["bytes"] == PARAM_BYTES
    print("mixed precision worst differences:", worst)


def test_fsdp_bf16_with_padded_labels(dist2):
    """Mixed precision and ranks counting different numbers of tokens together: the loss is still
    the global per-token mean (the count is reduced exactly; only bf16 rounding differs)."""
    worst, _ = dist2.run(mixed_precision_parity, 2, 0.3)[0]
    assert worst["loss"] < 1e-2, worst


def prefetch_order(depth):
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    options = {} if depth is None else {"prefetch_depth": depth}
    model = hp.parallelize(build_model("llama"), {"fully_shard": {"units": ["model.layers.*", ""]}}, mesh, **options)
    model(**global_batch("llama", 4, 16))["loss"].backward()
    c10d = torch.ops._c10d_functional
    report = {}
    for name, gm in zip(("forward", "backward"), model.compiled_programs()):
        nodes = list(gm.graph.nodes)
        index = {n: i for i, n in enumerate(nodes)}
        gathers = [n for n in nodes if n.target is c10d.all_gather_into_tensor.default]
        waits = [next(iter(g.users)) for g in gathers]
        # unit k's gather is issued before unit k-1's compute (matmuls; the root's embedding lookup)
        # and overlaps it (on gloo right after unit k-1's wait: one collective per group in flight,
        # serialize_collectives)
        compute = (torch.ops.aten.mm.default, torch.ops.aten.embedding.default)
        report[name] = [any(n.target in compute for n in nodes[index[gathers[k]]:index[waits[k]]])
                        for k in range(1, len(gathers))]
        report[name + "_most_in_flight"] = _most_in_flight(nodes)
        report[name + "_most_in_flight_per_group"] = max(
            (_most_in_flight(nodes, group) for group in {n.args[-1] for n in nodes if _is_collective(n)}), default=0)
        scatters = [n for n in nodes if n.target is c10d.reduce_scatter_tensor.default]
        report[name + "_groups"] = {"all_gather": sorted({g.args[-1] for g in gathers}),
                                    "reduce_scatter": sorted({s.args[-1] for s in scatters})}
        # at most one reduce-scatter in flight: unit k's is waited for after issuing it, before unit k+1's
        report[name + "_scatter"] = [
            index[s] < index[next(iter(s.users))] < (index[scatters[k + 1]] if k + 1 < len(scatters) else len(nodes))
            for k, s in enumerate(scatters)
        ]
        report[name + "_scatter_overlaps"] = sum(index[next(iter(s.users))] - index[s] > 1 for s in scatters)
    return report


def _is_collective(node) -> bool:
    return (getattr(node.target, "namespace", None) == "_c10d_functional"
            and node.target is not torch.ops._c10d_functional.wait_tensor.default)


def _most_in_flight(nodes, group: str | None = None) -> int:
    """The most collectives (of process group ``group``, default any) issued and not yet waited at
    any point of a program."""
    c10d = torch.ops._c10d_functional
    open_, most = set(), 0
    for n in nodes:
        if n.target is c10d.wait_tensor.default:
            open_.discard(n.args[0])
        elif _is_collective(n) and group in (None, n.args[-1]):
            open_.add(n)
            most = max(most, len(open_))
    return most


@pytest.mark.parametrize("depth", [1, None], ids=["depth1", "default"])
def test_prefetch_issues_next_unit_gather_early_and_bounds_reductions(dist2, depth):
    """Also the default on gloo: prefetch on (one unit ahead), one reduce-scatter in flight."""
    report = dist2.run(prefetch_order, depth)[0]
    # gloo: no process group ever has two collectives in flight (serialize_collectives), but the
    # reduce-scatters run on the axis's reduction lane (plan/lanes.py), so in backward the next
    # unit's gather and the last unit's reduction are in flight together
    assert report["forward_most_in_flight_per_group"] == report["backward_most_in_flight_per_group"] == 1, report
    assert report["forward_most_in_flight"] == 1 and report["backward_most_in_flight"] == 2, report
    gathers, scatters = report["backward_groups"]["all_gather"], report["backward_groups"]["reduce_scatter"]
    assert len(gathers) == len(scatters) == 1 and gathers != scatters, report["backward_groups"]
    assert report["forward"] == [True] * (UNITS - 1)
    assert report["backward"] == [True] * (UNITS - 1)
    assert report["backward_scatter"] == [True] * UNITS
    assert report["backward_scatter_overlaps"] >= UNITS - 1  # all but the last overlap compute


def test_fsdp_passes_off_keep_numerics(dist2):
    # run_parity asserts loss and every gradient against one device at each step.
    summary = dist2.run(
        run_parity, "llama", "fsdp", (2,), ("dp",),
        disable_passes=("prefetch", "bucketing", "reshard_after_forward"),
    )[0]["summary"]
    assert _coll(summary, "backward", "all_gather", "dp")["count"] == 0  # nothing re-gathered


def gradient_accumulation_parity(mesh_shape, mesh_names, method, micro_steps=4, steps=2):
    """4 micro-batches that skip communication (``method``: "gradient_sync" skips all of it,
    "all_reduce" only HSDP's replicate all-reduce) until the last == one step on the whole batch."""
    mesh = hp.init_device_mesh("cpu", mesh_shape, mesh_dim_names=mesh_names)
    reference = build_model("llama")
    model = hp.parallelize(copy.deepcopy(reference), {"fully_shard": {"units": ["model.layers.*", ""]}}, mesh)
    setter = {"gradient_sync": model.set_requires_gradient_sync, "all_reduce": model.set_requires_all_reduce}[method]
    collectives = []

    @contextlib.contextmanager
    def micro_step(record, i):
        setter(i == micro_steps - 1)
        yield
        collectives.append(model.compile_summary()["collectives"]["backward"])
        if i < micro_steps - 1:
            assert all(p.grad is None for p in model.parameters()), "no gradient before the sync step"

    # The micro-steps' losses (each / micro_steps) add up to one large batch's, and every gradient.
    ParityStepper(reference, model, mesh=mesh, batch=batches(batch=4 * micro_steps), micro_batches=micro_steps,
                  split=strided, reference_micro_batches=1, micro_context=micro_step,
                  loss_rtol=1e-5, loss_atol=1e-6).run(steps)
    return collectives, len(model._hp.cache)


@pytest.mark.parametrize(
    "mesh_shape,mesh_names,method",
    [
        ((2,), ("dp",), "gradient_sync"),
        ((2, 2), ("dp_replicate", "dp_shard"), "gradient_sync"),
        ((2, 2), ("dp_replicate", "dp_shard"), "all_reduce"),
    ],
)
def test_gradient_accumulation(dist2, dist4, mesh_shape, mesh_names, method):
    pool = {2: dist2, 4: dist4}[math.prod(mesh_shape)]
    backward, programs = pool.run(gradient_accumulation_parity, mesh_shape, mesh_names, method)[0]
    micro_steps, hsdp = 4, len(mesh_shape) == 2
    shard_axis = mesh_names[-1]
    # First micro-step, later micro-steps (pending gradients in), the sync step: 3 programs.
    assert programs == 3
    for i, summary in enumerate(backward):
        reduce_scatters = summary.get("reduce_scatter", {}).get(shard_axis, {}).get("count", 0)
        all_reduces = summary.get("all_reduce", {})
        if i % micro_steps == micro_steps - 1:
            # The sync step reduces everything accumulated once, in its compiled graph.
            assert reduce_scatters == UNITS
            if hsdp:
                assert all_reduces["dp_replicate"]["count"] == UNITS
        else:
            assert reduce_scatters == (UNITS if method == "all_reduce" else 0)
            assert all_reduces == {}, all_reduces  # nothing is all-reduced before the sync step


def reshard_flag_recompiles():
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = hp.parallelize(build_model("llama"), {"fully_shard": {"units": ["model.layers.*", ""]}}, mesh)
    batch = global_batch("llama", 2, 16)
    counts = []
    for flag in (True, False, True):
        model.set_reshard_after_forward(flag)
        model(**batch)["loss"].backward()
        counts.append(model.compile_summary()["collectives"]["backward"].get("all_gather", {}).get("dp", {}).get("count", 0))
    return counts, len(model._hp.cache)


def test_set_reshard_after_forward_recompiles_once_per_setting(dist2):
    counts, compiled = dist2.run(reshard_flag_recompiles)[0]
    assert counts == [UNITS, 0, UNITS] and compiled == 2


def fsdp_training_state_bytes():
    world = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = hp.parallelize(build_model("llama"), {"fully_shard": {"units": ["model.layers.*", ""]}}, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(**global_batch("llama", 4, 16))["loss"].backward()
    opt.step()

    def held_bytes(tensors):
        # Distinct storages: a unit's gradients are views of its one reduce-scatter output buffer.
        storages = {}
        for t in tensors:
            local = t.to_local() if hasattr(t, "to_local") else t
            storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        return sum(storages.values())

    params = held_bytes(model.parameters())
    grads = held_bytes(p.grad for p in model.parameters())
    state = held_bytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    return params, grads, state


def test_fsdp_per_rank_training_state_is_total_over_n(dist4):
    for params, grads, state in dist4.run(fsdp_training_state_bytes):
        # Every parameter is sharded 4 ways (no padding: dims divide), its gradient and both
        # AdamW moments likewise: each rank holds exactly a quarter of the model's training state.
        assert params == PARAM_BYTES // 4
        assert grads == PARAM_BYTES // 4
        assert state == 2 * PARAM_BYTES // 4


def offload_state_devices():
    from hyper_parallel.testing.parity import build_plan

    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = hp.parallelize(build_model("llama"), build_plan("fsdp_offload"), mesh)
    opt = torch.optim.AdamW(model.parameters())
    model(**global_batch("llama", 2, 16))["loss"].backward()
    opt.step()
    devices = {p.to_local().device.type for p in model.parameters()}
    devices |= {p.grad.to_local().device.type for p in model.parameters()}
    devices |= {v.to_local().device.type for s in opt.state.values() for v in s.values() if hasattr(v, "to_local")}
    return devices


def test_cpu_offload_parity_and_host_state(dist2):
    dist2.run(run_parity, "llama", "fsdp_offload", (2,), ("dp",))
    assert dist2.run(offload_state_devices)[0] == {"cpu"}


def test_uneven_shards_are_padded(dist4):
    # An MLP width of 126 does not divide over 4 ranks: shards of 32, 32, 32 and 30 rows, padded
    # inside the fused collectives (as FSDP2 pads); run_parity checks every gradient.
    overrides = {"hidden_size": 72, "intermediate_size": 126, "num_attention_heads": 3, "num_key_value_heads": 3}
    summary = dist4.run(run_parity, "llama", "fsdp", (4,), ("dp",), model_overrides=overrides)[0]["summary"]
    assert _coll(summary, "forward", "all_gather", "dp")["count"] == UNITS
    assert _coll(summary, "backward", "reduce_scatter", "dp")["count"] == UNITS


def explicit_prefetch_and_reduce_op():
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    reference = build_model("llama", num_hidden_layers=3)  # layer 0 prefetches layers 1 and 2
    model = copy.deepcopy(reference)
    layers = model.model.layers
    for layer in layers:
        hp.fully_shard(layer)
    hp.fully_shard(model)
    layers[0].set_modules_to_forward_prefetch([layers[1], layers[2]])
    model = hp.parallelize(model, None, mesh)
    from hyper_parallel.testing.parity import local_batch

    full = global_batch("llama", 4, 16)
    model(**local_batch(full, mesh))["loss"].backward()
    forward, _ = model.compiled_programs()
    c10d = torch.ops._c10d_functional
    nodes = list(forward.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    gathers = {n.meta["hp_fsdp_unit"]: n for n in nodes if n.target is c10d.all_gather_into_tensor.default}
    wait0 = next(iter(gathers["model.layers.0"].users))
    # Layers 1 and 2 are gathered before layer 0 computes (its first matmul after its wait); on
    # gloo each right after the previous collective's wait (serialize_collectives).
    compute0 = next(n for n in nodes[index[wait0]:] if n.target is torch.ops.aten.mm.default)
    early = [index[gathers[f"model.layers.{i}"]] < index[compute0] for i in (1, 2)]

    # "sum": the dp ranks' gradients summed = world x the gradients of the global mean loss.
    grads_avg = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.set_reduce_op_type("sum")
    model(**local_batch(full, mesh))["loss"].backward()
    world = dist.get_world_size()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), world * grads_avg[n])
    return early


def test_explicit_forward_prefetch_and_sum_reduction(dist2):
    assert dist2.run(explicit_prefetch_and_reduce_op)[0] == [True, True]


def _reduction_lanes():
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    plan = {"fully_shard": {"units": ["model.layers.*", ""]}}
    c10d = torch.ops._c10d_functional
    out = {}
    for name, options in (("on", {}), ("again", {}), ("off", {"disable_passes": ["reduction_lanes"]})):
        model = hp.parallelize(build_model("llama"), plan, mesh, **options)
        losses = []
        for step in range(2):
            loss = model(**global_batch("llama", 4, 16, seed=step + 1))["loss"]
            loss.backward()
            losses.append(loss.item())
        backward = model.compiled_programs()[1]
        out[name] = {
            "lanes": dict(model._hp.resolved.reduction_lanes),
            "scatter_groups": sorted({n.args[-1] for n in backward.graph.nodes
                                      if n.target is c10d.reduce_scatter_tensor.default}),
            "per_step": model.compile_summary(memory=False)["collectives_per_step"]["reduce_scatter"],
            "losses": losses,
            "grads": [p.grad.to_local().clone() for p in model.parameters()],
        }
    out["axis_group"] = mesh.get_group(0).group_name
    return out


def test_reduction_lanes_made_once_labelled_and_numerics_unchanged(dist2):
    """gloo: the gradient reduce-scatters run on the dp axis's reduction lane, a second group over
    the same ranks made once per process (a second parallelize reuses it); summaries still count
    them on 'dp'; turning the pass off puts them back on the axis's group with the same numbers."""
    for r in dist2.run(_reduction_lanes):
        on, again, off = r["on"], r["again"], r["off"]
        lane = on["lanes"][r["axis_group"]]
        assert lane != r["axis_group"], on["lanes"]
        assert on["scatter_groups"] == [lane] and again["lanes"] == on["lanes"], (on, again)
        assert off["scatter_groups"] == [r["axis_group"]], off
        assert on["per_step"] == off["per_step"] and list(on["per_step"]) == ["dp"], (on, off)
        assert on["losses"] == off["losses"]
        for a, b in zip(on["grads"], off["grads"]):
            assert torch.equal(a, b)
