"""The FSDP2 / HSDPModule methods that change what a step runs: unshard / reshard (gathering ahead
of forward), zero_grads, set_is_last_backward. Each keeps single-device numerics."""

import contextlib
import copy

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.testing.parity import build_model, global_batch, local_batch
from hyper_parallel.testing.stepper import ParityStepper, batches, strided

LAYERS = 2  # build_model("llama")'s default depth
UNITS = LAYERS + 1


def _gathers(model, direction):
    return model.compile_summary()["collectives"][direction].get("all_gather", {}).get("dp", {}).get("count", 0)


def _check_grads(model, reference):
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), ref[name].grad, msg=lambda m, name=name: f"{name}: {m}")


def unshard_ahead_of_forward():
    """Steps that gather ahead (all units, one unit, gathered then freed) equal the reference."""
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    reference = build_model("llama")
    model = copy.deepcopy(reference)
    for layer in model.model.layers:
        hp.fully_shard(layer, mesh=mesh)
    hp.fully_shard(model, mesh=mesh, reshard_after_forward=False)  # the root keeps its parameters
    model = hp.parallelize(model, None, mesh)
    gathers = []
    befores = ("none", "all", "one_layer", "unshard_then_reshard")

    def gather_ahead(record):
        before = befores[record.step]
        if before == "all":
            handle = model.unshard(async_op=True, recurse=True)
            handle.wait()
        elif before == "one_layer":
            assert model.model.layers[1].unshard() is None  # synchronous
        elif before == "unshard_then_reshard":
            model.unshard(recurse=True)
            model.reshard(recurse=True)

    ParityStepper(reference, model, mesh=mesh, before_step=gather_ahead,
                  before_optimizer=lambda r: gathers.append((_gathers(model, "forward"), _gathers(model, "backward"))),
                  ).run(len(befores))
    return gathers


def test_unshard_gathers_ahead_and_forward_skips_those_gathers(dist2):
    gathers = dist2.run(unshard_ahead_of_forward)[0]
    layers_regathered = LAYERS  # the layers reshard after forward; the root does not
    assert gathers[0] == (UNITS, layers_regathered)
    # Everything gathered ahead: no forward all-gather; the resharding layers gather in backward.
    assert gathers[1] == (0, layers_regathered)
    assert gathers[2] == (UNITS - 1, layers_regathered)
    assert gathers[3] == gathers[0]  # reshard() dropped what unshard() gathered


def zero_grads_drops_accumulated():
    """zero_grads() discards gradients accumulated without sync: the next synced step's gradients
    are that step's alone."""
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    reference = build_model("llama")
    model = hp.parallelize(copy.deepcopy(reference), {"fully_shard": {"units": ["model.layers.*", ""]}}, mesh)
    model.set_is_last_backward(True)  # accepted; compiled backwards never leave reductions in flight
    model.set_requires_gradient_sync(False)
    model(**local_batch(global_batch("llama", 4, 16, seed=7), mesh))["loss"].backward()
    assert model._hp.accumulator.buffers, "the unsynced step kept its gradients aside"
    model.zero_grads()
    model.set_requires_gradient_sync(True)
    full = global_batch("llama", 4, 16, seed=8)
    model(**local_batch(full, mesh))["loss"].backward()
    reference(**full)["loss"].backward()
    _check_grads(model, reference)
    return True


def test_zero_grads_discards_unsynced_gradients(dist2):
    assert dist2.run(zero_grads_drops_accumulated) == [True, True]


def method_errors():
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    messages = []
    dp_only = hp.parallelize(build_model("llama"), {}, mesh)
    for call in (dp_only.unshard, dp_only.zero_grads):
        try:
            call()
        except ValueError as e:
            messages.append(str(e))
    unsharded = build_model("llama")
    hp.fully_shard(unsharded.model.layers[0], mesh=mesh)
    try:
        unsharded.model.layers[0].unshard()
    except RuntimeError as e:
        messages.append(str(e))
    return messages


def test_method_errors_say_what_to_do(dist2):
    messages = dist2.run(method_errors)[0]
    assert len(messages) == 3
    assert "fully_shard" in messages[0] and "unshard" in messages[0]
    assert "zero_grads" in messages[1]
    assert "hp.parallelize" in messages[2]


def keep_gathered_through_accumulation(micro_steps=3, steps=2):
    """set_reshard_after_backward(False) during accumulation: micro-steps after the first gather
    nothing in forward; numbers equal one large batch; an optimizer step makes the kept values
    stale, so the next step gathers again."""
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    reference = build_model("llama")
    model = hp.parallelize(copy.deepcopy(reference), {"fully_shard": {"units": ["model.layers.*", ""]}}, mesh)
    gathers = []

    @contextlib.contextmanager
    def micro_step(record, i):
        last = i == micro_steps - 1
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        yield
        gathers.append((_gathers(model, "forward"), _gathers(model, "backward")))

    # Every gradient after the micro-steps (each loss / micro_steps) against one large batch.
    stepper = ParityStepper(reference, model, mesh=mesh, batch=batches(batch=4 * micro_steps),
                            micro_batches=micro_steps, split=strided, reference_micro_batches=1,
                            micro_context=micro_step, check_loss=False)
    stepper.run(steps)
    full, opt = stepper.records[-1].batch, stepper.optimizer
    # An optimizer step between a kept gather and the next forward: the kept values are dropped.
    model.set_reshard_after_backward(False)
    model(**local_batch(full, mesh))["loss"].backward()
    opt.step()
    model(**local_batch(full, mesh))["loss"].backward()
    gathers.append((_gathers(model, "forward"), _gathers(model, "backward")))
    return gathers


def test_reshard_after_backward_false_skips_forward_gathers(dist2):
    gathers = dist2.run(keep_gathered_through_accumulation)[0]
    first, later = gathers[0], gathers[1]
    assert first[0] == UNITS  # the first micro-step gathers every unit
    assert later[0] == 0  # later micro-steps use what backward kept
    assert gathers[2][0] == 0 and gathers[3][0] == UNITS  # a new step (after opt.step) gathers again
    assert gathers[-1][0] == UNITS, "values kept before an optimizer step must not be used after it"


def _no_sync_accumulation(plan_name: str) -> list[int]:
    """DDP's / FSDP1's idiom: ``with model.no_sync(): loss.backward()`` for every micro-batch but
    the last, padded labels (ranks count different tokens), 2 optimizer steps of 3 micro-batches
    against one device accumulating the same micro-batch losses. Nothing is reduced inside the
    context (FSDP: no reduce-scatter; data parallelism: no gradient all-reduce, which every
    backward used to run), everything once after it. ``model.no_sync()`` used to be an
    AttributeError. In the second step an evaluation under ``torch.no_grad()`` runs between two
    micro-steps: its forward took (and lost) the kept gradients. Returns each backward's
    reductions."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    # "fsdp_layers": units for the layers only, so the embedding, final norm and head stay
    # replicated over dp: one program keeps both kinds of gradients (FSDP's and DDP-style).
    plan = {"fsdp": {"fully_shard": {"units": ["model.layers.*", ""]}},
            "fsdp_layers": {"fully_shard": {"units": ["model.layers.*"]}}, "dp": {}}[plan_name]
    reference = build_model("llama")
    model = hp.parallelize(copy.deepcopy(reference), plan, mesh)
    reductions = []

    @contextlib.contextmanager
    def micro_step(record, i):
        with model.no_sync() if i < 2 else contextlib.nullcontext():
            yield
        backward = model.compile_summary()["collectives"]["backward"]
        reductions.append(sum(v["count"] for kind in ("reduce_scatter", "all_reduce")
                              for v in backward.get(kind, {}).values()))
        if record.step == 1 and i == 0:  # an evaluation while gradients are kept: they stay kept
            with torch.no_grad():
                model(**record.local[i])

    # Both sides accumulate the same 3 micro-batches (each loss / 3); every gradient after them.
    ParityStepper(reference, model, mesh=mesh, batch=batches(batch=12, ignore_fraction=0.3), micro_batches=3,
                  split=strided, micro_context=micro_step, check_loss=False).run(2)
    return reductions


def test_no_sync_accumulates_as_one_device(dist2):
    fsdp = dist2.run(_no_sync_accumulation, "fsdp")[0]
    assert fsdp[:2] == [0, 0] and fsdp[2] >= UNITS, fsdp  # reduced once, a reduce-scatter per unit
    dp = dist2.run(_no_sync_accumulation, "dp")[0]
    assert dp[:2] == [0, 0] and dp[2] > 0, dp
    mixed = dist2.run(_no_sync_accumulation, "fsdp_layers")[0]
    assert mixed[:2] == [0, 0] and mixed[2] > LAYERS, mixed
