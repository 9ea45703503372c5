"""Vocab-parallel cross-entropy ("loss parallel"): logits sharded over the vocabulary by a
column-parallel ``lm_head`` go into the loss without being gathered (propagation/rules.py).

Every parity case compares the loss and every gradient with one device's at each of 3 SGD steps
(``run_parity``), with labels of -100 so ranks and rows count different numbers of tokens. The
structure test reads the compiled forward program: between ``lm_head`` and the loss there is no
all-gather, only all-reduces of ``[tokens]``-sized values (the max and the exp-sum of the
log-softmax) and of the scalar loss.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate

import hyper_parallel as hp
from hyper_parallel.ir.graph import module_fqn_of
from hyper_parallel.models import llama_tp_plan
from hyper_parallel.testing.parity import build_model, error_message, global_batch, local_batch, run_parity
from hyper_parallel.testing.stepper import ParityStepper, batches

PADDED = 0.3  # labels set to -100 at this rate, plus a whole row (global_batch)
NUM_LAYERS = 2  # the example Llama, 2 layers: the loss does not depend on the depth
SMALL = {"num_hidden_layers": NUM_LAYERS}
c10d = torch.ops._c10d_functional
aten = torch.ops.aten
_MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default)


def _counts(summary, direction, kind, axis):
    return summary["collectives"][direction].get(kind, {}).get(axis, {})


# --- reading the compiled forward program -------------------------------------------------------

def _loss_path_collectives(gm: torch.fx.GraphModule, head: str) -> list[tuple[str, str, int, str]]:
    """(collective, reduce op or "", numel, dtype) of every collective between the output of module
    ``head`` (its compute nodes) and the loss (the program's first output): the nodes that are both
    downstream of the head and upstream of the loss."""
    graph = gm.graph
    loss = graph.output_node().args[0][0]
    upstream, stack = set(), [loss]
    while stack:
        node = stack.pop()
        if node not in upstream:
            upstream.add(node)
            stack.extend(node.all_input_nodes)
    downstream = set()
    for node in graph.nodes:  # topological order: a node is downstream if an input is
        if module_fqn_of(node) == head and node.target in _MATMULS or \
                any(a in downstream for a in node.all_input_nodes):
            downstream.add(node)
    found = []
    for node in graph.nodes:
        if node in upstream and node in downstream and node.op == "call_function" and \
                getattr(node.target, "namespace", None) == "_c10d_functional" and \
                node.target is not c10d.wait_tensor.default:
            val = node.meta["val"]
            op = node.args[1] if node.target is c10d.all_reduce.default else ""
            found.append((node.target._opname, op, val.numel(), str(val.dtype)))
    return found


def loss_path(plan_name: str, vocab: int = 256, batch: int = 4, seq_len: int = 16) -> dict:
    """Compile the example Llama under a TP plan on this pool's ranks (one forward + backward) and
    return the collectives on its loss path, with the sizes to judge them by."""
    plan = {"tp": llama_tp_plan(), "lp": llama_tp_plan(loss_parallel=True),
            "sp_lp": llama_tp_plan(sequence_parallel=True, loss_parallel=True)}[plan_name]
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = hp.parallelize(build_model("llama", vocab_size=vocab, num_hidden_layers=1), plan, mesh)
    out = model(**global_batch("llama", batch, seq_len, ignore_fraction=PADDED))
    out["loss"].backward()
    forward, _ = model.compiled_programs()
    return {"collectives": _loss_path_collectives(forward, "lm_head"),
            "tokens": batch * seq_len, "vocab": vocab}  # every position (the last label ignored)


@pytest.mark.parametrize("plan", ["tp", "lp", "sp_lp"])
def test_no_logits_gather_on_the_loss_path(dist2, plan):
    """Between lm_head and the loss: no all-gather; all-reduces of at most one value per token
    (the log-softmax's max and exp-sum over the vocabulary), and the loss scalar. "tp" is the
    default plan (``lm_head`` a plain ``"colwise"``, whose logits are vocab-sharded too)."""
    result = dist2.run(loss_path, plan)[0]
    found, tokens = result["collectives"], result["tokens"]
    assert found, "no collective between lm_head and the loss: the logits were not vocab-sharded"
    gathers = [c for c in found if c[0] != "all_reduce"]
    assert not gathers, f"the loss path gathers: {gathers}"
    assert all(numel <= tokens for _, _, numel, _ in found), found
    ops = sorted(op for _, op, _, _ in found)
    # max and exp-sum of the log-softmax (one value per token each), the loss's partial sum.
    assert ops == ["max", "sum", "sum"], found


# --- parity with one device ---------------------------------------------------------------------

def test_tp_parity_padded_labels(dist2):
    results = dist2.run(run_parity, "llama", llama_tp_plan(loss_parallel=True), (2,), ("tp",),
                        ignore_fraction=PADDED, model_overrides=SMALL)
    summary = results[0]["summary"]
    # Forward: Megatron's 2 per layer + the embedding; the log-softmax's max and exp-sum; the loss.
    assert _counts(summary, "forward", "all_reduce", "tp")["count"] == 2 * NUM_LAYERS + 1 + 3
    # Nothing is gathered: the returned logits stay vocab-sharded (a DTensor, see below).
    assert not _counts(summary, "forward", "all_gather", "tp")
    # Backward: mirrored, + the log-softmax backward's sum over the vocabulary.
    assert _counts(summary, "backward", "all_reduce", "tp")["count"] == 2 * NUM_LAYERS + 1 + 1
    assert not _counts(summary, "backward", "all_gather", "tp")
    assert summary["fallbacks"] == []


def test_tp_sp_parity_padded_labels(dist2):
    results = dist2.run(run_parity, "llama", llama_tp_plan(sequence_parallel=True, loss_parallel=True),
                        (2,), ("tp",), ignore_fraction=PADDED, model_overrides=SMALL)
    summary = results[0]["summary"]
    # Per layer 2 all-gathers (attention and MLP inputs) and the final norm's for lm_head: none for
    # the loss or the returned logits.
    assert _counts(summary, "forward", "all_gather", "tp")["count"] == 2 * NUM_LAYERS + 1
    assert _counts(summary, "forward", "all_reduce", "tp")["count"] == 3
    assert summary["fallbacks"] == []


def test_hf_llama_parity_padded_labels(dist2):
    pytest.importorskip("transformers")
    results = dist2.run(run_parity, "hf_llama", llama_tp_plan(loss_parallel=True), (2,), ("tp",),
                        ignore_fraction=PADDED)
    summary = results[0]["summary"]
    assert summary["fallbacks"] == [], summary["fallbacks"]
    assert not _counts(summary, "forward", "all_gather", "tp")  # the logits stay sharded


# --- the logits returned to the caller --------------------------------------------------------

def returned_logits() -> dict:
    """The example Llama under loss-parallel TP on this pool's ``tp`` ranks, against one device:
    by default the logits come back as a DTensor over ``tp``, vocab-sharded, and a loss the caller
    computes from them (through ``full_tensor()``) gets the right gradients; with
    ``outputs={"logits": Replicate()}`` they come back whole, as a plain tensor, for one all-gather."""
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    reference = build_model("llama", num_hidden_layers=1)
    batch = global_batch("llama", 4, 16, ignore_fraction=PADDED)
    ref = reference(**batch)
    ((ref["logits"].float() ** 2).mean() + ref["loss"]).backward()
    result = {}

    sharded = hp.parallelize(copy.deepcopy(reference), llama_tp_plan(loss_parallel=True), mesh)
    out = sharded(**local_batch(batch, mesh))
    logits = out["logits"]
    result["type"] = type(logits).__name__
    result["placements"] = [str(p) for p in logits.placements]
    result["mesh_axes"] = logits.device_mesh.mesh_dim_names
    result["local_shape"] = tuple(logits.to_local().shape)
    torch.testing.assert_close(logits.full_tensor(), ref["logits"])
    ((logits.full_tensor().float() ** 2).mean() + out["loss"]).backward()
    ref_grads = dict(reference.named_parameters())
    for name, p in sharded.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), ref_grads[name].grad,
                                   msg=lambda m, name=name: f"grad of {name}: {m}")
    result["sharded_gathers"] = _counts(sharded.compile_summary(), "forward", "all_gather", "tp")

    plan = {**llama_tp_plan(loss_parallel=True), "outputs": {"logits": Replicate()}}
    whole = hp.parallelize(copy.deepcopy(reference), plan, mesh)
    out = whole(**local_batch(batch, mesh))
    result["whole_type"] = type(out["logits"]).__name__
    torch.testing.assert_close(out["logits"], ref["logits"])
    result["whole_gathers"] = _counts(whole.compile_summary(), "forward", "all_gather", "tp")

    bad = hp.parallelize(copy.deepcopy(reference), {**llama_tp_plan(), "outputs": {"logit": Replicate()}}, mesh)
    result["unknown_name"] = error_message(bad, **local_batch(batch, mesh))
    return result


def test_returned_logits_stay_sharded_unless_the_plan_asks(dist2):
    result = dist2.run(returned_logits)[0]
    assert result["type"] == "DTensor" and result["placements"] == ["S(2)"], result
    assert result["mesh_axes"] == ("tp",) and result["local_shape"] == (4, 16, 128), result
    assert not result["sharded_gathers"], result
    assert result["whole_type"] == "Tensor", result
    assert result["whole_gathers"] == {"count": 1, "bytes": 4 * 16 * 256 * 4 // 2}, result
    assert result["unknown_name"] == (
        "ValueError: outputs['logit'] matches none of the values the model returns ['loss', 'logits']; "
        "name one of them (or a glob over them)"), result["unknown_name"]


# --- reductions, class weights, an ignore_index that is a class ---------------------------------

class TinyLM(nn.Module):
    """Embedding + a vocabulary head + ``F.cross_entropy`` with the given options. For
    ``reduction="none"`` the per-token losses are weighted by their position before summing, so
    each token's gradient differs."""

    def __init__(self, reduction: str, weighted: bool, ignore_index: int, vocab: int = 32, hidden: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.reduction, self.ignore_index = reduction, ignore_index
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, vocab) if weighted else None)

    def forward(self, ids, labels):
        logits = self.head(self.embed(ids)).flatten(0, 1)
        loss = F.cross_entropy(logits, labels.flatten(), weight=self.class_weight,
                               ignore_index=self.ignore_index, reduction=self.reduction)
        if self.reduction == "none":
            loss = (loss * torch.arange(1, loss.numel() + 1, dtype=loss.dtype)).sum() / loss.numel()
        return loss


def tiny_lm_parity(cases, steps: int = 2) -> list[dict]:
    """For each (reduction, weighted, ignore_index): TinyLM with a column-parallel head on a
    ``tp`` mesh of this pool's ranks, loss and every gradient against one device at each SGD step.
    Returns the forward collectives of each compile."""
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    summaries = []
    for reduction, weighted, ignore_index in cases:
        torch.manual_seed(0)
        reference = TinyLM(reduction, weighted, ignore_index)
        model = hp.parallelize(copy.deepcopy(reference), {"tensor_parallel": {"head": "colwise"}}, mesh)

        def batch(step, ignore_index=ignore_index):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 32, (4, 8), generator=g)
            labels = torch.randint(0, 32, (4, 8), generator=g)
            labels[torch.rand(labels.shape, generator=g) < 0.3] = ignore_index
            labels[0, :4] = 3  # a class that is the ignore_index in some cases
            return {"ids": ids, "labels": labels}

        ParityStepper(reference, model, mesh=mesh, batch=batch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5),
                      what=f"reduction={reduction} weighted={weighted} ignore_index={ignore_index}").run(steps)
        summaries.append(model.compile_summary()["collectives"]["forward"])
    return summaries


def test_reductions_class_weights_and_ignore_index(dist2):
    cases = [("mean", False, -100), ("mean", True, 3), ("sum", True, -100), ("none", False, 3),
             ("none", True, -100)]
    summaries = dist2.run(tiny_lm_parity, cases)[0]
    for case, forward in zip(cases, summaries):
        # The logits ([32 tokens, 32 classes], fp32) are never gathered: only the loss is returned.
        assert "all_gather" not in forward, (case, forward)
        assert forward["all_reduce"]["tp"]["count"] >= 2, (case, forward)


# --- bf16 mixed precision with data parallelism (FSDP x TP, 4 ranks) -----------------------------

def mixed_precision_fsdp_tp(steps: int = 2) -> dict:
    """FSDP (bf16 parameters, fp32 reduction) x loss-parallel TP on a 2x2 mesh, against one device
    doing the same casts (as tests/fsdp/test_fsdp.py's mixed-precision test): bf16 rounds
    at different points, so the tolerances are bf16's."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    master = build_model("llama", num_hidden_layers=2)
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = {**llama_tp_plan(loss_parallel=True),
            "fully_shard": hp.FullyShard(units=("model.layers.*", ""), mixed_precision=policy)}
    model = hp.parallelize(copy.deepcopy(master), plan, mesh)
    # Against one device computing in bf16 from the fp32 master (which steps with its gradients).
    last = ParityStepper(master, model, mesh=mesh, batch=batches(ignore_fraction=PADDED), bf16_reference=True,
                         ).run(steps)[-1]
    forward, _ = model.compiled_programs()
    logits = last.output["logits"]
    # Over the tp sub-mesh only: on dp the caller holds its own part of the batch, as for inputs.
    torch.testing.assert_close(logits.full_tensor(), last.ref_output["logits"].chunk(2)[mesh.get_local_rank("dp")],
                               rtol=1e-2, atol=1e-2)
    return {"summary": model.compile_summary(), "loss_path": _loss_path_collectives(forward, "lm_head"),
            "logits_dtype": str(logits.dtype), "logits_shape": tuple(logits.shape),
            "logits_mesh": logits.device_mesh.mesh_dim_names, "local_shape": tuple(logits.to_local().shape)}


def test_bf16_fsdp_tp_parity_padded_labels(dist4):
    result = dist4.run(mixed_precision_fsdp_tp)[0]
    # The loss path reads the vocab-sharded logits: no gather; per-token max and exp-sum in fp32
    # (the loss computes in fp32), the loss's partial sum reduced over tp, then the sum and the
    # token count together over dp (one packed all_reduce_ of 2 values).
    assert [c for c in result["loss_path"] if c[0] not in ("all_reduce", "all_reduce_")] == [], result["loss_path"]
    assert ("all_reduce_", "", 2, "torch.float32") in result["loss_path"], result["loss_path"]
    assert all(numel <= 2 * 16 for _, _, numel, _ in result["loss_path"]), result["loss_path"]  # this rank's tokens
    # No tp all-gather at all: the returned logits stay vocab-sharded, in bf16, this dp rank's rows.
    assert not _counts(result["summary"], "forward", "all_gather", "tp"), result["summary"]
    assert result["logits_dtype"] == "torch.bfloat16" and result["logits_shape"] == (2, 16, 256)
    assert result["logits_mesh"] == ("tp",) and result["local_shape"] == (2, 16, 128), result
