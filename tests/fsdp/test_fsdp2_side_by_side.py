"""hyper_parallel FSDP vs PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``), side by side.

Both shard the example Llama with the same units (each ``model.layers[i]``, then the root), start
from the same weights (same seed), get the same per-rank local batches and take 5 SGD steps
(lr 0.1). FSDP2 runs eagerly on gloo/CPU; hyper_parallel runs its compiled program.

Expected: **bitwise** equal fp32 gradients and parameters, at 2 and 4 ranks, and losses equal to
the last bits. Why it holds:
* Forward: both all-gather the same shards (exact) and run the same aten kernels on the same local
  batch, so every rank computes the same bits up to its loss.
* Loss: FSDP2's loss is the rank's local mean; its global loss is ``all_reduce(sum) / world``.
  hyper_parallel's loss is one device's ``sum / count``: the ranks' summed losses and token counts
  all-reduced together, then divided. With equal token counts both are the global mean, rounded at
  different points (a mean of means against a sum divided once): equal to ``rtol=1e-6``, not
  bitwise. The loss value feeds no gradient, so this does not reach the gradients.
* Gradients: FSDP2 (fp32, no divide factor set) reduce-scatters the local-mean gradients with
  ``ReduceOp.AVG`` (``_get_gradient_divide_factors``), i.e. ``sum(g_r) / world``. hyper_parallel's
  ``nll_loss_backward`` uses the *global* token count, so each rank's gradient is ``g_r / world``
  (again exact for a power of two, and every backward op is linear in the incoming gradient), then
  a ``"sum"`` reduce-scatter whose fused buffer has FSDP2's layout (rank ``i``'s chunk is shard
  ``i`` of every parameter of the unit), so gloo adds the same values in the same order.

This exactness is a property of power-of-two data-parallel degrees: at 3 ranks (a model whose dims
divide by 3) gradients differ in the last bit (max |diff| ~5e-8), because ``1 / (3 n)`` is not ``(1 / n) / 3`` in floating point and
``sum(g / 3)`` is not ``sum(g) / 3``. Such runs are equal only to ``assert_close`` defaults.
"""

import copy

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.testing.parity import build_model, global_batch, local_batch

STEPS = 5
LR = 0.1
GLOBAL_BATCH, SEQ_LEN = 8, 16


def _mismatches(named_a: dict, named_b: dict) -> dict[str, float]:
    """Names whose full tensors are not bitwise equal -> max |a - b| (gathers every DTensor)."""
    out = {}
    for name, a in named_a.items():
        a, b = a.full_tensor(), named_b[name].full_tensor()
        if not torch.equal(a, b):
            out[name] = (a - b).abs().max().item()
    return out


def fsdp2_vs_hp(reshard_after_forward: bool = True, hp_style: str = "plan") -> dict:
    """Runs on every rank: train FSDP2 and hyper_parallel side by side for ``STEPS`` SGD steps.

    Returns, per step, both global losses (floats) and the parameters whose gradients differ
    bitwise, and after the last step the parameters that differ bitwise.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    reference = build_model("llama")

    fsdp2 = copy.deepcopy(reference)
    torch_mesh = init_device_mesh("cpu", (world,))
    for layer in fsdp2.model.layers:
        fully_shard(layer, mesh=torch_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(fsdp2, mesh=torch_mesh, reshard_after_forward=reshard_after_forward)

    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = copy.deepcopy(reference)
    if hp_style == "plan":
        units = hp.FullyShard(units=("model.layers.*", ""), reshard_after_forward=reshard_after_forward)
        model = hp.parallelize(model, {"fully_shard": units}, mesh)
    else:  # the FSDP2-style calls, exactly as FSDP2 is applied above
        for layer in model.model.layers:
            hp.fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
        hp.fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
        model = hp.parallelize(model, None, mesh)

    fsdp2_opt = torch.optim.SGD(fsdp2.parameters(), lr=LR)
    hp_opt = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    for step in range(STEPS):
        batch = local_batch(global_batch("llama", GLOBAL_BATCH, SEQ_LEN, seed=step + 1), mesh)
        hp_loss = model(**batch)["loss"]
        hp_loss.backward()
        fsdp2_loss = fsdp2(**batch)["loss"]  # this rank's local mean
        fsdp2_loss.backward()
        global_loss = fsdp2_loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss /= world
        grad_diffs = _mismatches(
            {n: p.grad for n, p in model.named_parameters()},
            {n: p.grad for n, p in fsdp2.named_parameters()},
        )
        steps.append({"hp": hp_loss.item(), "fsdp2": global_loss.item(), "grad_diffs": grad_diffs})
        for opt in (hp_opt, fsdp2_opt):
            opt.step()
            opt.zero_grad()
    param_diffs = _mismatches(dict(model.named_parameters()), dict(fsdp2.named_parameters()))
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    fsdp2_placements = {n: str(p.placements) for n, p in fsdp2.named_parameters()}
    return {"steps": steps, "param_diffs": param_diffs, "placements": placements,
            "fsdp2_placements": fsdp2_placements}


def _check(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["placements"] == r["fsdp2_placements"], f"rank {rank}: parameter placements differ"
        for step, s in enumerate(r["steps"]):
            # The loss to its last bits (module docstring); gradients exactly, on purpose.
            assert abs(s["hp"] - s["fsdp2"]) <= 1e-6 * abs(s["fsdp2"]), \
                f"rank {rank} step {step}: loss hp {s['hp']!r} != FSDP2 {s['fsdp2']!r}"
            assert not s["grad_diffs"], f"rank {rank} step {step}: gradients differ bitwise: {s['grad_diffs']}"
        assert not r["param_diffs"], f"rank {rank}: parameters after {STEPS} steps differ: {r['param_diffs']}"
    # Every rank reports the same global losses.
    assert len({tuple(s["hp"] for s in r["steps"]) for r in results}) == 1


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_side_by_side_bitwise(dist2, dist4, world):
    pool = {2: dist2, 4: dist4}[world]
    _check(pool.run(fsdp2_vs_hp))


def test_fsdp2_side_by_side_no_reshard_fsdp2_style_calls(dist4):
    _check(dist4.run(fsdp2_vs_hp, reshard_after_forward=False, hp_style="calls"))
