"""A loss the caller computes outside the model, from the outputs it gets back (HF ``Trainer``-style
loops: ``logits = model(ids).logits`` then cross-entropy).

On the data-parallel axes each rank gets its own rows back and computes a per-rank loss, as under
DDP or FSDP2, which average the ranks' gradients: a per-rank mean then trains as the global mean
does on one device. The program used to sum them, so the same loop silently trained with N times
the gradient. Checked here against one device on the whole batch (equal token counts per rank, as a
per-rank mean needs to be the global one) over three SGD steps: DP on HF Llama, FSDP, and DP x TP
with the vocab-parallel logits returned as a DTensor."""

import copy

import pytest
import torch
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel.models.plans import llama_tp_plan
from hyper_parallel.testing.parity import build_model, build_plan
from hyper_parallel.testing.stepper import ParityStepper, batches, sgd

STEPS, LR = 3, 0.1


def _logits(out) -> torch.Tensor:
    logits = out["logits"] if isinstance(out, dict) else out.logits
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits  # whole over tp, own rows


def _caller_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over this caller's tokens."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def _ids_only(model, batch):
    """The caller's forward: the input ids alone, the loss computed from what comes back."""
    return model(input_ids=batch["input_ids"])


# Every gradient (gathered whole) against the reference's, each step; the per-rank losses are not
# one device's loss, so they are not compared.
CHECK = {"rtol": 1e-4, "atol": 1e-6, "check_loss": False}


def _train_with_caller_loss(model_name: str, plan, shape: tuple, names: tuple) -> list:
    mesh = hp.init_device_mesh("cpu", shape, mesh_dim_names=names)
    reference = build_model(model_name)
    model = hp.parallelize(copy.deepcopy(reference), build_plan(plan) if isinstance(plan, str) else plan, mesh)
    stepper = ParityStepper(reference, model, mesh=mesh, optimizer=sgd(LR), forward=_ids_only,
                            loss=lambda out, b: _caller_loss(_logits(out), b["labels"]), **CHECK)
    stepper.run(STEPS)
    return stepper.losses


@pytest.mark.parametrize("model,plan,axis", [("hf_llama", "dp", "dp"), ("llama", "fsdp", "dp_shard")])
def test_caller_loss_on_own_rows_trains_as_one_device(dist2, model, plan, axis):
    if model.startswith("hf"):
        pytest.importorskip("transformers")
    losses = dist2.run(_train_with_caller_loss, model, plan, (2,), (axis,))
    assert losses[0] != losses[1]  # each rank's own rows: per-rank losses


def _padded_labels_trainer_style() -> list:
    """Padded labels (-100, ranks counting different tokens): transformers' Trainer then divides
    each rank's summed loss by the step's global token count and multiplies by the number of
    ranks (``average_tokens_across_devices``), undoing DDP's averaging; one device's global mean
    must come out exactly. HF Llama under FSDP, 2 SGD steps."""
    import torch.distributed as dist

    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    reference = build_model("hf_llama")
    model = hp.parallelize(copy.deepcopy(reference), build_plan("fsdp"), mesh)

    def trainer_loss(out, mine):
        total = int((stepper.current.batch["labels"][:, 1:] != -100).sum())
        logits = out.logits
        summed = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), mine["labels"][:, 1:].flatten(), reduction="sum")
        return summed / total * dist.get_world_size()

    counts = []
    stepper = ParityStepper(reference, model, mesh=mesh, batch=batches(ignore_fraction=0.3), optimizer=sgd(LR),
                            forward=_ids_only, loss=trainer_loss,
                            ref_loss=lambda out, full: _caller_loss(out.logits, full["labels"]),
                            after_step=lambda r: counts.append(int((r.local[0]["labels"][:, 1:] != -100).sum())),
                            **CHECK)
    stepper.run(2)
    return counts


def test_trainer_style_global_token_count_with_padded_labels(dist2):
    pytest.importorskip("transformers")
    counts = dist2.run(_padded_labels_trainer_style)
    assert counts[0] != counts[1], counts  # the ranks count different tokens


def test_caller_loss_from_vocab_parallel_logits_under_dp_x_tp(dist4):
    plan = llama_tp_plan(loss_parallel=True)
    dist4.run(_train_with_caller_loss, "llama", plan, (2, 2), ("dp", "tp"))


def _caller_loss_mixed_precision() -> list:
    """bf16 parameters with fp32 reduction (FSDP2's usual policy): the caller's per-rank mean of
    bf16 logits. Each gradient is compared with one fp32 device's by its relative error: bf16
    rounding stays within a few percent, the N-times gradient of the old semantics is off by 100%."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    reference = build_model("hf_llama")
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = hp.parallelize(copy.deepcopy(reference), {"fully_shard": {"units": ["model.layers.*", ""],
                                                                       "mixed_precision": policy}}, mesh)
    worst = []

    def bf16_logits_loss(out, mine):
        logits = _logits(out)
        assert logits.dtype == torch.bfloat16
        return _caller_loss(logits, mine["labels"])

    def relative_errors(record):
        grads = dict(reference.named_parameters())
        errors = {}
        for name, p in model.named_parameters():
            g, ref = p.grad.full_tensor().float(), grads[name].grad
            errors[name] = ((g - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        name = max(errors, key=errors.get)
        assert errors[name] < 0.05, f"step {record.step}: grad of {name} off by {errors[name]:.1%} relative"
        worst.append(errors[name])

    ParityStepper(reference, model, mesh=mesh, optimizer=sgd(LR), forward=_ids_only, loss=bf16_logits_loss,
                  ref_loss=lambda out, full: _caller_loss(_logits(out), full["labels"]), check_loss=False,
                  grads=relative_errors).run(2)
    return worst


def test_caller_loss_under_mixed_precision(dist2):
    pytest.importorskip("transformers")
    worst = dist2.run(_caller_loss_mixed_precision)
    assert all(0 < w < 0.05 for w in worst[0])  # bf16 rounding, not exact: the check can fail
