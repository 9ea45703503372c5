"""FSDP ``reshard_after_forward=<int>`` (FSDP2 semantics) on 4 ranks: after forward each rank keeps
1/k of a unit's parameters and backward gathers them over a group of k contiguous ranks. Numerics
equal one device (and ``reshard_after_forward=True``, bit for bit); the collectives and the saved
bytes equal the analytic values."""

import copy

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.testing.parity import build_model, global_batch, local_batch
from hyper_parallel.testing.stepper import ParityStepper

LAYERS = 2  # build_model("llama")'s default depth
UNITS = LAYERS + 1  # model.layers.* and the root (embedding, final norm, lm_head)
PARAM_BYTES = 106_816 * 4  # the example Llama's parameters at 2 layers, fp32
EMBEDDING_BYTES = 256 * 64 * 4  # not needed by backward: never re-gathered there
UNIT_PLAN = ("model.layers.*", "")


def _coll(summary, direction, kind, axis):
    return summary["collectives"][direction].get(kind, {}).get(axis, {"count": 0, "bytes": 0})


def _mesh():
    return hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))


def _plan(reshard):
    return {"fully_shard": hp.FullyShard(units=UNIT_PLAN, reshard_after_forward=reshard)}


def _with_calls(model, mesh, layer_reshard, root_reshard):
    for layer in model.model.layers:
        hp.fully_shard(layer, mesh=mesh, reshard_after_forward=layer_reshard)
    hp.fully_shard(model, mesh=mesh, reshard_after_forward=root_reshard)
    return hp.parallelize(model, None, mesh)


def reshard_int_vs_true(k, steps=3):
    """Reference, reshard_after_forward=k and =True side by side: k matches one device
    (assert_close) and True exactly (losses and gradients bitwise)."""
    mesh = _mesh()
    reference = build_model("llama")
    smaller = hp.parallelize(copy.deepcopy(reference), _plan(k), mesh)
    full_reshard = hp.parallelize(copy.deepcopy(reference), _plan(True), mesh)
    true_opt = torch.optim.SGD(full_reshard.parameters(), lr=0.1)

    def bitwise_equal_to_true(record):  # reshard_after_forward=True takes the same step
        true_loss = full_reshard(**record.local[0])["loss"]
        true_loss.backward()
        loss, step = record.loss, record.step
        assert torch.equal(loss, true_loss.detach()), f"step {step}: loss {loss.item()} vs {true_loss.item()} with True"
        true_params = dict(full_reshard.named_parameters())
        for name, p in smaller.named_parameters():
            assert torch.equal(p.grad.to_local(), true_params[name].grad.to_local()), f"step {step} grad of {name}"

    def step_true(record):
        true_opt.step()
        true_opt.zero_grad()

    ParityStepper(reference, smaller, mesh=mesh, after_backward=bitwise_equal_to_true,
                  before_optimizer=step_true).run(steps)
    return smaller.compile_summary(), full_reshard.compile_summary()


def test_reshard_to_2_of_4_matches_one_device_and_reshard_true_bitwise(dist4):
    results = dist4.run(reshard_int_vs_true, 2)
    summary, true_summary = results[0]
    k, world = 2, 4
    # Forward: unchanged, one fused all-gather per unit over the whole shard axis.
    assert summary["collectives"]["forward"] == true_summary["collectives"]["forward"]
    fwd = _coll(summary, "forward", "all_gather", "dp")
    assert fwd == {"count": UNITS, "bytes": PARAM_BYTES // world}
    # Backward: one fused all-gather per unit over the group of k ranks, none over the whole axis.
    # Each rank's input is 1/k of the unit (the same total bytes arrive as with True).
    assert _coll(summary, "backward", "all_gather", "dp")["count"] == 0
    bwd = _coll(summary, "backward", "all_gather", f"dp/k{k}")
    assert bwd == {"count": UNITS, "bytes": (PARAM_BYTES - EMBEDDING_BYTES) // k}
    true_bwd = _coll(true_summary, "backward", "all_gather", "dp")
    assert true_bwd["bytes"] * world // k == bwd["bytes"]
    assert summary["collectives"]["backward"]["reduce_scatter"] == true_summary["collectives"]["backward"]["reduce_scatter"]
    # Kept from forward to backward: 1/k of every parameter backward needs (True keeps none).
    assert summary["saved_for_backward"]["gathered_param_bytes"] == (PARAM_BYTES - EMBEDDING_BYTES) // k
    assert true_summary["saved_for_backward"]["gathered_param_bytes"] == 0
    # The group label hides per-rank group names: every rank compiled the same program.
    assert len({s["spmd_hash"] for s, _ in results}) == 1


def per_unit_calls_uneven():
    """hp.fully_shard calls: layers reshard to 2 ranks, the root keeps its parameters (False); a
    vocabulary and MLP width that do not divide by 4 (padded shards). Parity over 3 SGD steps."""
    overrides = {"vocab_size": 250, "intermediate_size": 126}
    mesh = _mesh()
    reference = build_model("llama", **overrides)
    model = _with_calls(copy.deepcopy(reference), mesh, layer_reshard=2, root_reshard=False)
    ParityStepper(reference, model, mesh=mesh,
                  batch=lambda step: {k: v % 250 for k, v in global_batch("llama", 4, 16, seed=step + 1).items()},
                  ).run(3)
    return model.compile_summary(), {u.module_fqn: u.reshard_after_forward for u in model._hp.resolved.fsdp.units}


def test_per_unit_int_from_fully_shard_calls_with_uneven_shards(dist4):
    summary, reshard = dist4.run(per_unit_calls_uneven)[0]
    assert reshard == {**{f"model.layers.{i}": 2 for i in range(LAYERS)}, "": False}
    assert _coll(summary, "forward", "all_gather", "dp")["count"] == UNITS
    # Only the layers gather again in backward, over 2 ranks; the root kept its parameters.
    assert _coll(summary, "backward", "all_gather", "dp")["count"] == 0
    assert _coll(summary, "backward", "all_gather", "dp/k2")["count"] == LAYERS
    # A layer as gathered: gate/up [126, 64] padded to 4 x 32 rows, down [64, 126], 2 norms, q and
    # o [64, 64], k and v [32, 64]. Each rank keeps (and sends in backward) half of it, padding included.
    gathered = (2 * 128 * 64 + 64 * 126 + 2 * 64 + 2 * 64 * 64 + 2 * 32 * 64) * 4
    assert _coll(summary, "backward", "all_gather", "dp/k2")["bytes"] == LAYERS * gathered // 2
    assert summary["saved_for_backward"]["gathered_param_bytes"] > LAYERS * gathered // 2  # + the root's


def normalised_ints():
    """k == 1 compiles as False and k == world size as True (FSDP2's normalisation)."""
    mesh = _mesh()
    out = {}
    for k in (1, dist.get_world_size()):
        model = hp.parallelize(build_model("llama", num_hidden_layers=1), _plan(k), mesh)
        model(**local_batch(global_batch("llama", 4, 16), mesh))["loss"].backward()
        out[k] = (model.compile_summary(), {u.reshard_after_forward for u in model._hp.resolved.fsdp.units})
    return out


def test_int_1_and_world_size_are_false_and_true(dist4):
    out = dist4.run(normalised_ints)[0]
    (keep, keep_flags), (reshard, reshard_flags) = out[1], out[4]
    assert keep_flags == {False} and reshard_flags == {True}
    units = 1 + 1
    for summary in (keep, reshard):
        assert _coll(summary, "forward", "all_gather", "dp")["count"] == units
        assert set(summary["collectives"]["backward"].get("all_gather", {})) <= {"dp"}  # no smaller group
    # False: nothing gathered again in backward, the gathered parameters are kept; True: the reverse.
    assert _coll(keep, "backward", "all_gather", "dp")["count"] == 0
    assert keep["saved_for_backward"]["gathered_param_bytes"] > 0
    assert _coll(reshard, "backward", "all_gather", "dp")["count"] == units
    assert reshard["saved_for_backward"]["gathered_param_bytes"] == 0


def bad_int(style):
    mesh = _mesh()
    model = build_model("llama")
    if style == "plan":
        return hp.parallelize(model, _plan(3), mesh)
    return _with_calls(model, mesh, layer_reshard=3, root_reshard=True)


@pytest.mark.parametrize(
    "style,match",
    [
        ("plan", r"fully_shard reshard_after_forward=3 must divide the shard axis dp=4.*\[1, 2, 4\]"),
        ("calls", r"fully_shard unit 'model.layers.0': reshard_after_forward=3 must divide the shard axis dp=4"),
    ],
)
def test_int_that_does_not_divide_the_shard_axis(dist4, style, match):
    with pytest.raises(ValueError, match=match):
        dist4.run(bad_int, style)
