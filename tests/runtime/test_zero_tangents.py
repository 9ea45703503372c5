"""Outputs that get no gradient (runtime/zero_tangents.py).

A model returning its loss and its logits, trained with ``loss.backward()``: the logits' gradient
is never materialised (autograd hands None) and the backward program runs without adding it. The
numbers stay one device's, using the logits in the loss still works, the collectives are those of
the full program (ranks may differ in which outputs they use), and the memory estimate follows.
"""

import torch
from torch.distributed.tensor import DTensor

import hyper_parallel as hp
from hyper_parallel.analysis.debug import collectives
from hyper_parallel.testing.parity import build_model, global_batch, local_batch
from hyper_parallel.testing.memory_tracker import MemoryTracker

RING = {"context_parallel": {"model.layers.*.self_attn": hp.ContextParallel(mode="ring")}}


def _tangent_users(gm) -> list[int]:
    return [len(n.users) for n in gm.graph.find_nodes(op="placeholder") if n.name.startswith("tangents_")]


def _step(model, batch, mode: str):
    """One backward: ``loss`` (``loss.backward()``), ``zeros`` (the logits given an explicit zero
    gradient: what autograd handed the program before, a tangent of their full size) or
    ``logits`` (a loss that uses them: plus the mean of their squares, z-loss style, each rank's
    over its own rows: a per-rank term, averaged over the data-parallel ranks as DDP does, so
    one device's mean over the batch)."""
    out = model(**batch)
    if mode == "loss":
        out["loss"].backward()
    elif mode == "zeros":
        torch.autograd.backward([out["loss"], out["logits"]], [torch.ones_like(out["loss"]),
                                                                torch.zeros_like(out["logits"])])
    else:
        squares = out["logits"].float().pow(2).mean()
        if isinstance(squares, DTensor):  # logits returned sharded (context parallelism): the global mean
            squares = squares.full_tensor()
        (out["loss"] + squares).backward()


def _unused_logits(plan: dict, names: tuple[str, ...]) -> dict:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=names)
    reference = build_model("llama", num_hidden_layers=1)
    parallel = hp.parallelize(build_model("llama", num_hidden_layers=1), plan, mesh)
    full = global_batch("llama", 4, 16, ignore_fraction=0.3)
    _step(parallel, local_batch(full, mesh), "loss")  # compiles: not measured
    for p in parallel.parameters():
        p.grad = None
    result = {}
    for mode in ("loss", "zeros", "logits"):
        # The smallest peak of three identical steps: now and then a finished gloo work releases its
        # collective's output after the program's last use of it (test_memory_estimator.py says
        # more), which can only add to a measured peak (1 run in 6 here, with or without lanes).
        peaks = []
        for _ in range(3):
            for p in parallel.parameters():
                p.grad = None
            memory = MemoryTracker(list(parallel.parameters()))
            with memory:
                _step(parallel, local_batch(full, mesh), mode)
            peaks.append(memory.peak)
        _step(reference, full, "loss" if mode == "zeros" else mode)
        ref_grads = dict(reference.named_parameters())
        for name, p in parallel.named_parameters():
            torch.testing.assert_close(p.grad.full_tensor(), ref_grads[name].grad, msg=lambda m: f"{mode} {name}: {m}")
        program = parallel._hp.last.program
        result[mode] = {"missing": program.last_missing_tangents, "measured": min(peaks),
                        "estimate": parallel.memory_report()["peak_backward"]}
        for p in (*parallel.parameters(), *reference.parameters()):
            p.grad = None
    full_program, without = program.backward_gm, program.backward_without((1,))
    result["tangent_users"] = {"full": _tangent_users(full_program), "without": _tangent_users(without)}
    result["same_collectives"] = [c.signature() for c in collectives(full_program, {})] == \
        [c.signature() for c in collectives(without, {})]
    logits = parallel(**local_batch(full, mesh))["logits"]
    result["logits_bytes"] = (logits.to_local() if isinstance(logits, DTensor) else logits).numel() * 4
    return result


def _check(result: dict) -> None:
    assert result["loss"]["missing"] == (1,), result  # the logits' tangent
    assert result["zeros"]["missing"] == result["logits"]["missing"] == (), result
    assert result["tangent_users"]["full"][1] >= 1 and result["tangent_users"]["without"][1] == 0, result
    assert result["same_collectives"]
    # The zero gradient no longer allocated, and no longer added in: at least one logits-sized
    # buffer less at the backward's peak, measured and estimated alike.
    for what in ("measured", "estimate"):
        assert result["zeros"][what] - result["loss"][what] >= result["logits_bytes"], (what, result)


def test_unused_logits_get_no_gradient_data_parallel(dist2):
    for result in dist2.run(_unused_logits, {}, ("dp",)):
        _check(result)


def test_unused_logits_get_no_gradient_context_parallel(dist2):
    """Under load-balanced ring attention the logits' tangent is reordered by an all-to-all: the
    program without it still runs that all-to-all (on zeros), so every rank issues the same
    collectives whichever outputs its loss used."""
    for result in dist2.run(_unused_logits, RING, ("cp",)):
        _check(result)
