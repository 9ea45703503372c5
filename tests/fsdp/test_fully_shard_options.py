"""``hp.fully_shard`` options that change sharding or numerics, against one device: a parameter
stored on dim 1 (``shard_placement_fn``), one unit over two modules, ``ignored_params``, per-unit
mixed precision with the casts at unit boundaries, ``mesh=`` sub-meshes (FSDP and 2-D HSDP), the
FSDP2 switches on non-root units (``set_reduce_scatter_divide_factor``, ``recurse=``), and the
errors for what is refused. Resolution-only checks: tests/fsdp/test_fully_shard_option_resolution.py."""

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

import hyper_parallel as hp
from hyper_parallel.testing.parity import (
    assert_gradients_near_exact, build_model, float64_gradients, global_batch, local_batch,
)
from hyper_parallel.testing.stepper import ParityStepper, batches

LAYERS = 2
ROOT_PARAMS = 2 * 256 * 64 + 64  # embedding, lm_head, final norm of the example Llama
LAYER_PARAMS = (180_800 - ROOT_PARAMS) // 4


def _dim1(param):
    return Shard(1) if param.dim() == 2 else None


# Padded labels: ranks count different tokens. Each step the loss and every gradient must match.
PADDED = batches(ignore_fraction=0.3)


def _check_grads(model, ref_grads, scale=None):
    for name, p in model.named_parameters():
        factor = (scale or {}).get(name, 1.0)
        torch.testing.assert_close(p.grad.full_tensor(), factor * ref_grads[name], msg=lambda m, name=name: f"{name}: {m}")


def _sgd(*models):
    return [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]


def _step_optimizers(optimizers):
    for opt in optimizers:
        opt.step()
        opt.zero_grad()


def _counts(model, direction):
    return {kind: by_axis["dp"]["count"] for kind, by_axis in model.compile_summary()["collectives"][direction].items()
            if "dp" in by_axis}


def sharding_options_and_unit_switches():
    world = dist.get_world_size()
    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    errors = []
    # A mesh over the same axis but other ranks' order is not parallelize's sub-mesh.
    reversed_mesh = DeviceMesh("cpu", list(reversed(range(world))), mesh_dim_names=("dp",))
    other = build_model("llama", num_hidden_layers=1)
    hp.fully_shard(other, mesh=reversed_mesh)
    try:
        hp.parallelize(other, None, mesh)
    except ValueError as e:
        errors.append(str(e))

    reference = build_model("llama", num_hidden_layers=LAYERS)
    model = copy.deepcopy(reference)
    for layer in model.model.layers:
        hp.fully_shard(layer, mesh=mesh, shard_placement_fn=_dim1)
    hp.fully_shard([model.model.embed_tokens, model.lm_head], mesh=mesh)  # one unit, two modules
    hp.fully_shard(model, mesh=mesh, ignored_params={model.model.norm.weight})  # the root keeps no parameter
    model = hp.parallelize(model, None, mesh)
    placements = {n: p.placements for n, p in model.named_parameters()}
    ParityStepper(reference, model, mesh=mesh, batch=PADDED).run(3)
    default = (_counts(model, "forward"), _counts(model, "backward"))
    switched = []

    # Switches on non-root units act on that unit only.
    layers = model.model.layers
    layers[0].set_gradient_divide_factor(1.0)  # its gradients: the ranks' sum, not their mean
    layers[0].set_reshard_after_backward(False)  # its backward returns its gathered parameters
    layers[1].set_reshard_after_forward(False, recurse=False)  # its backward gathers nothing
    summed = {n: float(world) for n, _ in reference.named_parameters() if n.startswith("model.layers.0.")}
    # No optimizer step (it would drop what is kept): the gradients are dropped after each step.
    switches = ParityStepper(
        reference, model, mesh=mesh, batch=PADDED, optimizer=None,
        grads=lambda r: _check_grads(model, {n: p.grad for n, p in reference.named_parameters()}, summed),
        before_optimizer=lambda r: switched.append((_counts(model, "forward"), _counts(model, "backward"))),
        after_step=lambda r: layers[0].set_reshard_after_backward(True))
    for seed in (4, 5):  # the second forward uses layers.0's kept parameters
        switches.step(seed - 1)  # global_batch seed = step + 1

    # What is refused, with the reason.
    for call in (
        lambda: model.set_reduce_scatter_divide_factor(2.0),  # not recursive; the root is no unit here
        lambda: model.set_reshard_after_forward(False, recurse=False),
        lambda: layers[0].set_reduce_scatter_divide_factor(0),
    ):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    layers[0].set_requires_gradient_sync(False, recurse=False)  # the other units still sync
    try:
        model(**local_batch(global_batch("llama", 4, 16), mesh))
    except ValueError as e:
        errors.append(str(e))
    return placements, default, switched, errors


def test_sharding_options_parity_and_switches_on_units(dist2):
    placements, default, switched, errors = dist2.run(sharding_options_and_unit_switches)[0]
    assert placements["model.layers.0.mlp.up_proj.weight"] == (Shard(1),)  # shard_placement_fn
    assert placements["model.layers.1.post_attention_layernorm.weight"] == (Shard(0),)  # fn gave None
    assert placements["lm_head.weight"] == placements["model.embed_tokens.weight"] == (Shard(0),)
    assert placements["model.norm.weight"] == (Replicate(),)  # ignored: replicated, all-reduced
    units = LAYERS + 1  # the layers and the embedding + lm_head unit; the root has no parameter left
    forward, backward = default
    assert forward["all_gather"] == units and backward["all_gather"] == units
    assert backward["reduce_scatter"] == units
    assert backward["all_reduce"] == 1  # the ignored norm's gradient, as data parallelism
    # layers.1 keeps its gathered parameters from forward: one all-gather fewer in backward; and
    # the forward after layers.0 kept its gathered parameters through backward gathers one fewer.
    assert switched[0] == (forward, {**backward, "all_gather": units - 1})
    assert switched[1] == ({**forward, "all_gather": units - 1}, {**backward, "all_gather": units - 1})
    assert "holds ranks [1, 0] on cpu, but parallelize's mesh has [0, 1]" in errors[0]
    assert "set_reduce_scatter_divide_factor: the root module is not an FSDP unit, and this call acts" in errors[1]
    assert "set_reshard_after_forward: the root module is not an FSDP unit" in errors[2]
    assert "set_reduce_scatter_divide_factor takes a positive number, got 0" in errors[3]
    assert "set_requires_gradient_sync differs between FSDP units" in errors[4]
    assert "False on ['model.layers.0']" in errors[4] and "True on ['model.embed_tokens', 'model.layers.1']" in errors[4]
    assert len(errors) == 5


BF16_LAYERS = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)


def _bf16_layers_reference(master, batch):
    """One device doing what the units do: fp32 embedding and head; bf16 layers whose floating
    inputs are cast to bf16 and outputs to fp32 (FSDP2's cast_forward_inputs / output_dtype)."""
    compute = copy.deepcopy(master)

    def cast(dtype):
        return lambda x: x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x

    for layer in compute.model.layers:
        layer.to(torch.bfloat16)
        layer.register_forward_pre_hook(
            lambda m, args, kwargs: torch.utils._pytree.tree_map(cast(torch.bfloat16), (args, kwargs)), with_kwargs=True)
        layer.register_forward_hook(lambda m, args, out: torch.utils._pytree.tree_map(cast(torch.float32), out))
    loss = compute(**batch)["loss"]
    loss.backward()
    return compute, loss


def per_unit_mixed_precision(steps=2):
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    master = build_model("llama", num_hidden_layers=LAYERS)
    model = copy.deepcopy(master)
    for layer in model.model.layers:
        hp.fully_shard(layer, mixed_precision=BF16_LAYERS)  # the reference's spelling
    hp.fully_shard(model)  # the root computes in fp32
    model = hp.parallelize(model, None, mesh)
    optimizers = _sgd(model, master)
    worst = 0.0
    for step in range(steps):
        full = global_batch("llama", 4, 16, seed=step + 1, ignore_fraction=0.3)
        compute, ref_loss = _bf16_layers_reference(master, full)
        out = model(**local_batch(full, mesh))
        out["loss"].backward()
        torch.testing.assert_close(out["loss"], ref_loss, rtol=1e-2, atol=1e-2)
        # The exact gradients at the weights each part computes with: the layers' rounded to bf16.
        rounded = copy.deepcopy(master)
        for layer in rounded.model.layers:
            for q in layer.parameters():
                q.data = q.data.bfloat16().float()
        exact = float64_gradients(rounded, lambda m: m(**full)["loss"].backward())
        assert_gradients_near_exact(model, exact, {n: q.grad for n, q in compute.named_parameters()},
                                    f"step {step}: ")
        for (name, p), ref in zip(model.named_parameters(), compute.parameters()):
            assert p.dtype == p.grad.dtype == torch.float32, name  # fp32 masters, fp32 reduction
            worst = max(worst, (p.grad.full_tensor() - ref.grad.float()).abs().max().item())
        for p, ref in zip(master.parameters(), compute.parameters()):
            p.grad = ref.grad.float()
        _step_optimizers(optimizers)
    gathered = model.compile_summary()["collectives"]["forward"]["all_gather"]["dp"]["bytes"]

    # The root's policy casts its own floating inputs (the MLP's x and target) unless told not to.
    dtypes = {}
    for name, policy in {
        "cast": hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        "output_fp32": hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32),
        "no_cast": hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False),
    }.items():
        mlp = hp.fully_shard(build_model("mlp"), mp_policy=policy)
        mlp = hp.parallelize(mlp, None, mesh)
        try:
            dtypes[name] = mlp(**local_batch(global_batch("mlp", 4, 0), mesh)).dtype
        except RuntimeError as e:
            dtypes[name] = str(e)
    return worst, str(out["logits"].dtype), gathered, dtypes


def test_per_unit_mixed_precision_and_boundary_casts(dist2):
    worst, logits_dtype, gathered, dtypes = dist2.run(per_unit_mixed_precision)[0]
    print("per-unit mixed precision, worst gradient difference:", worst)
    assert logits_dtype == "torch.float32"  # the fp32 head after the layers' output_dtype cast
    # Each rank gathers the layers' shards in bf16 and the root's in fp32.
    assert gathered == (LAYERS * LAYER_PARAMS * 2 + ROOT_PARAMS * 4) // 2
    assert dtypes["cast"] == torch.bfloat16 and dtypes["output_fp32"] == torch.float32
    # Without the cast the fp32 input meets the bf16 weight: nothing was cast.
    assert "must have the same dtype" in dtypes["no_cast"], dtypes["no_cast"]


def mesh_options():
    """On a (dp, fsdp) mesh, whose default shard axis is fsdp: ``mesh["dp"]`` shards over dp
    instead, the whole 2-D mesh is HSDP (replicate over dp, shard over fsdp), as FSDP2."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "fsdp"))
    out = {}
    for kind, unit_mesh in (("sub_mesh", mesh["dp"]), ("hsdp_2d", mesh)):
        reference = build_model("llama", num_hidden_layers=1)
        model = copy.deepcopy(reference)
        hp.fully_shard(model.model.layers[0], mesh=unit_mesh)
        hp.fully_shard(model, mesh=unit_mesh)
        model = hp.parallelize(model, None, mesh)
        ParityStepper(reference, model, mesh=mesh, batch=PADDED).run(2)
        backward = model.compile_summary()["collectives"]["backward"]
        out[kind] = model.lm_head.weight.placements, {
            kind: {axis: v["count"] for axis, v in by_axis.items()} for kind, by_axis in backward.items()}
    return out


def test_unit_mesh_picks_the_fsdp_axes(dist4):
    out = dist4.run(mesh_options)[0]
    placements, backward = out["sub_mesh"]
    assert placements == (Shard(0), Replicate())
    # Two units reduce-scattered over dp; over fsdp (data parallel here) their gradients are all-reduced.
    assert backward["reduce_scatter"] == {"dp": 2} and backward["all_reduce"] == {"fsdp": 2}
    placements, backward = out["hsdp_2d"]
    assert placements == (Replicate(), Shard(0))
    assert backward["reduce_scatter"] == {"fsdp": 2} and backward["all_reduce"] == {"dp": 2}  # HSDP
