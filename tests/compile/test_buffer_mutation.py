"""Buffers updated in forward (BatchNorm running statistics), on 2 gloo ranks.

A conv net with BatchNorm2d trains 3 SGD steps under DP and FSDP (fp32, and bf16 compute with fp32
reduction); after every step the loss, every gradient and every buffer (``running_mean``,
``running_var``, ``num_batches_tracked``) must equal what one device computes on the whole batch:
global batch statistics, as SyncBatchNorm, with SyncBatchNorm's communication (per-channel
all-reduces, no activation moved). Then eval-mode forwards (running statistics, no update; programs
compiled apart, since the train/eval mode is part of the program cache key) must match the
reference's eval output, and one more training step the reference's again. Also: other buffers
updated in forward (an EMA of a batch reduction, an int64 counter), the rejection of writes into
inputs and parameters, and each batch-norm decomposition against torch's kernel.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.models import ConvNet
from hyper_parallel.testing.parity import local_batch
from hyper_parallel.testing.stepper import ParityStepper

STEPS = 3
BATCH = 8
FSDP_UNITS = ["blocks.*", ""]
NUM_FSDP_UNITS = 3  # blocks.0, blocks.1 (ConvNet's two blocks) and the root (the head)


def _plan(name: str, mixed: bool = False):
    if name == "dp":
        return {}
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
    return {"fully_shard": {"units": FSDP_UNITS, "mixed_precision": policy}}


def _batch(seed: int, dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, 3, 8, 8, generator=g) * 2 + 0.5  # statistics far from (0, 1)
    return {"x": x.to(dtype), "labels": torch.randint(0, 10, (BATCH,), generator=g)}


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _stepper(model, reference, mesh, batch, tol, worst, **options) -> ParityStepper:
    """The parallel model against the reference, each step: the loss and every gradient (``tol``'s
    tolerances), then every buffer; ``worst`` keeps the largest differences."""
    def worst_and_buffers(record):
        worst["loss"] = max(worst["loss"], abs(record.loss.item() - record.ref_loss.item()))
        ref_params = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            worst["grad"] = max(worst["grad"], (p.grad.full_tensor() - ref_params[name].grad).abs().max().item())
        _check_buffers(model, reference, record.step, tol, worst)

    return ParityStepper(reference, model, mesh=mesh, batch=batch, before_optimizer=worst_and_buffers,
                         **tol["grad"], **{f"loss_{k}": v for k, v in tol["loss"].items()}, **options)


def _check_buffers(model, reference, step, tol, worst) -> None:
    ref_buffers = dict(reference.named_buffers())
    assert set(ref_buffers) == {n for n, _ in model.named_buffers()}
    for name, b in model.named_buffers():
        b, ref = _full(b), ref_buffers[name]
        assert b.dtype == ref.dtype, (name, b.dtype, ref.dtype)
        torch.testing.assert_close(b, ref, **tol["buffer"], msg=lambda m, name=name: f"step {step} buffer {name}: {m}")
        worst["buffer"] = max(worst["buffer"], (b.double() - ref.double()).abs().max().item())


# fp32: exact up to summation order (assert_close defaults). bf16 compute against the fp32
# reference: bf16 keeps 8 mantissa bits, the running statistics stay fp32 (computed in fp32 from
# bf16 activations).
EXACT = {"loss": {}, "grad": {}, "buffer": {}, "eval": {}}
BF16_VS_FP32 = {
    "loss": dict(rtol=1e-2, atol=1e-2),
    "grad": dict(rtol=5e-2, atol=1e-2),
    "buffer": dict(rtol=1e-2, atol=2e-3),
    "eval": dict(rtol=5e-2, atol=1e-2),
}


def bn_parity(plan_name: str, track_running_stats: bool = True, mixed: bool = False) -> dict:
    """Train the parallel model and the one-device reference side by side (3 SGD steps), then
    evaluate both in eval mode, then train one more step; return the worst differences, the
    compile summaries (training and eval) and the memory report."""
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    reference = ConvNet(track_running_stats=track_running_stats)
    model = hp.parallelize(copy.deepcopy(reference), _plan(plan_name, mixed), mesh)
    tol = BF16_VS_FP32 if mixed else EXACT
    dtype = torch.bfloat16 if mixed else torch.float32  # no input cast in the program: feed bf16 images
    worst = {"loss": 0.0, "grad": 0.0, "buffer": 0.0, "eval": 0.0}
    # The reference computes in fp32 on the same images; the loss compared in fp32.
    stepper = _stepper(model, reference, mesh, lambda step: _batch(step + 1, dtype), tol, worst,
                       loss=lambda out, batch: out["loss"].float(),
                       ref_forward=lambda m, b: m(**{k: (v.float() if v.is_floating_point() else v) for k, v in b.items()}))
    stepper.run(STEPS)
    summary = model.compile_summary()
    memory = model.memory_report(stepper.optimizer)

    # Eval mode: the running statistics normalise, nothing is updated. The same input signature as
    # training (x, labels) must get its own program (the mode is part of the cache key), and so
    # must logits-only calls.
    model.eval(), reference.eval()
    full = _batch(100, dtype)
    local = local_batch(full, mesh)
    before = {n: _full(b).clone() for n, b in model.named_buffers()}
    with torch.no_grad():
        out = model(**local)
        logits = model(local["x"])
        ref_out = reference(full["x"].float(), labels=full["labels"])
    ref_local = ref_out["logits"].chunk(dist.get_world_size())[dist.get_rank()]
    for got in (out["logits"], logits):
        torch.testing.assert_close(got.float(), ref_local, **tol["eval"])
        worst["eval"] = max(worst["eval"], (got.float() - ref_local).abs().max().item())
    torch.testing.assert_close(out["loss"].float(), ref_out["loss"], **tol["loss"])
    for name, b in model.named_buffers():
        torch.testing.assert_close(_full(b), before[name], rtol=0, atol=0, msg=f"eval mode changed buffer {name}")
    eval_summary = model.compile_summary()

    # Back to training: the cached training program again, the buffers carry on.
    model.train(), reference.train()
    stepper.step(STEPS)
    return {"worst": worst, "summary": summary, "eval_summary": eval_summary, "memory": memory,
            "programs": len(model._hp.cache)}


def _bn_layer_collectives(summary) -> dict:
    return {phase: {kind: axes.get("dp", {}).get("count", 0) for kind, axes in colls.items()}
            for phase, colls in summary["collectives"].items()}


ACTIVATION_BYTES = BATCH // 2 * 8 * 8 * 8 * 4  # one rank's BatchNorm input, fp32


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_batch_norm_running_stats_parity(dist2, plan):
    result = dist2.run(bn_parity, plan)[0]
    print(plan, result["worst"], result["summary"]["collectives"], result["eval_summary"]["collectives"])
    # Train (x, labels), eval (x, labels), eval (x): three programs; training again hits the cache.
    assert result["programs"] == 3
    colls = _bn_layer_collectives(result["summary"])
    forward = result["summary"]["collectives"]["forward"]
    # SyncBatchNorm's communication, no activation moved: per BatchNorm layer one all-reduce of the
    # [C] mean and one of the [C] variance (2 layers; the loss adds one or two scalars), and no
    # all-gather but FSDP's of the parameters (one per unit).
    assert 2 * 2 < colls["forward"]["all_reduce"] <= 2 * 2 + 2
    assert forward["all_reduce"]["dp"]["bytes"] < ACTIVATION_BYTES // 16
    assert colls["forward"].get("all_gather", 0) == (NUM_FSDP_UNITS if plan == "fsdp" else 0)
    assert result["memory"]["peak"] > 0
    # Eval mode, logits only: normalised with the running statistics, nothing to reduce.
    assert "all_reduce" not in result["eval_summary"]["collectives"]["forward"]


def test_batch_norm_without_running_stats(dist2):
    """track_running_stats=False: batch statistics always, no buffers; the same global statistics."""
    result = dist2.run(bn_parity, "dp", False)[0]
    print(result["worst"], result["summary"]["collectives"])
    assert _bn_layer_collectives(result["summary"])["forward"].get("all_gather", 0) == 0
    assert result["summary"]["collectives"]["forward"]["all_reduce"]["dp"]["bytes"] < ACTIVATION_BYTES // 16


def test_batch_norm_mixed_precision_fsdp(dist2):
    """bf16 parameters and activations, fp32 reduction and running statistics, against the fp32
    one-device reference (tolerances: BF16_VS_FP32)."""
    result = dist2.run(bn_parity, "fsdp", True, True)[0]
    print(result["worst"], result["summary"]["collectives"])


class FeatureStats(torch.nn.Module):
    """Buffers updated in forward outside BatchNorm: an exponential average of the batch's mean
    feature (a reduction over the batch, so Partial on shards) and an int64 step counter."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 4)
        self.register_buffer("feature_mean", torch.zeros(6))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x, target):
        with torch.no_grad():
            self.feature_mean.mul_(0.9).add_(0.1 * x.mean(0))
            self.steps += 1
        return torch.nn.functional.mse_loss(self.proj(x - self.feature_mean), target)


def ema_parity() -> dict:
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    reference = FeatureStats()
    model = hp.parallelize(copy.deepcopy(reference), {}, mesh)
    worst = {"loss": 0.0, "grad": 0.0, "buffer": 0.0}

    def batch(step):
        g = torch.Generator().manual_seed(step)
        return {"x": torch.randn(BATCH, 6, generator=g) + 1, "target": torch.randn(BATCH, 4, generator=g)}

    _stepper(model, reference, mesh, batch, EXACT, worst).run(STEPS)
    return {"worst": worst, "steps": int(_full(model.steps))}


def test_other_buffers_updated_in_forward(dist2):
    result = dist2.run(ema_parity)[0]
    assert result["steps"] == STEPS


class InputWriter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 4)

    def forward(self, x):
        x.mul_(2)
        return self.proj(x).sum()


class ParamWriter(InputWriter):
    def forward(self, x):
        with torch.no_grad():
            self.proj.weight.mul_(0.5)
        return self.proj(x).sum()


def mutation_errors() -> list[str]:
    from hyper_parallel.testing.parity import error_message

    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    return [error_message(hp.parallelize(cls(), {}, mesh), x=torch.randn(4, 6)) for cls in (InputWriter, ParamWriter)]


def test_other_mutations_are_rejected(dist2):
    """Writing into an input (a shard the caller never sees) or a parameter (owned by the optimizer)
    in forward: a ValueError naming it and what to do."""
    input_message, param_message = dist2.run(mutation_errors)[0]
    assert input_message.startswith("ValueError") and "writes into its input 'x'" in input_message, input_message
    assert param_message.startswith("ValueError") and "parameter 'proj.weight'" in param_message, param_message


def pipelined_batch_norm() -> str:
    from hyper_parallel.models import ConvNet
    from hyper_parallel.testing.parity import error_message

    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("pp",))
    plan = {"pipeline": {"split_points": ["blocks.1"], "num_microbatches": 2}}
    model = hp.parallelize(ConvNet(), plan, mesh)
    return error_message(model.step, _batch(0))


def test_pipeline_refuses_buffer_updates(dist2):
    """Pipeline stages do not write buffers back yet: refused, not silently left unchanged."""
    for message in dist2.run(pipelined_batch_norm):
        assert message.startswith("ValueError: pipeline: the model updates buffers in forward (blocks.0.1."), message


@pytest.mark.parametrize("shape", [(6, 4), (6, 4, 5), (6, 4, 5, 5)])
def test_batch_norm_decompositions_match_the_kernels(shape):
    """Every batch-norm variant capture decomposes (CPU and cuDNN-path ops alike) equals torch's
    kernel on one device, forward (training, eval, no running statistics) and backward."""
    from hyper_parallel.compile.decompositions import batch_norm_decompositions

    aten = torch.ops.aten
    table = batch_norm_decompositions()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3 + 1
    c = shape[1]
    w, b, rm, rv = torch.randn(c, generator=g), torch.randn(c, generator=g), torch.randn(c, generator=g), torch.rand(c, generator=g) + 0.5
    for op, args in [
        (aten._native_batch_norm_legit_functional.default, (x, w, b, rm, rv, True, 0.1, 1e-5)),
        (aten._batch_norm_with_update_functional.default, (x, w, b, rm, rv, 0.1, 1e-5)),
        (aten._native_batch_norm_legit_no_training.default, (x, w, b, rm, rv, 0.1, 1e-5)),
        (aten._batch_norm_no_update.default, (x, w, b, rm, rv, 0.1, 1e-5)),
        (aten._native_batch_norm_legit.no_stats, (x, None, b, True, 0.1, 1e-5)),
    ]:
        for i, (got, want) in enumerate(zip(table[op](*args), op(*args))):
            if want.numel() and want.dtype != torch.uint8:  # not cuDNN's reserve
                torch.testing.assert_close(got, want, msg=lambda m: f"{op} output {i}: {m}")
    _, save_mean, save_invstd = aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5)
    grad_out = torch.randn(shape, generator=g)
    for train, weight, mask in [(True, w, [True, True, True]), (False, w, [True, True, True]),
                                (True, None, [True, False, False]), (True, w, [False, True, True])]:
        args = (grad_out, x, weight, rm, rv, save_mean, save_invstd, train, 1e-5, mask)
        for got, want in zip(table[aten.native_batch_norm_backward.default](*args), aten.native_batch_norm_backward(*args)):
            if want is not None:
                torch.testing.assert_close(got, want)
