"""passes/inplace_reuse.py in training: what it saves at the loss, that turning it off changes no
number, and that ``backward(retain_graph=True)`` still sees the saved activations it was given.

The model is the loss's end of a language model (an embedding standing for the decoder, a
column-parallel ``lm_head``, torchtitan's cross-entropy on ``logits.float()``), the vocabulary
sharded over 2 ranks: the loss runs vocab-parallel, and its temporaries are counted in units of one
rank's fp32 logits.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel.ir import meta
from hyper_parallel.models import llama_tp_plan
from hyper_parallel.testing.memory_tracker import MemoryTracker
from hyper_parallel.testing.parity import build_model, global_batch, local_batch
from hyper_parallel.testing.stepper import ParityStepper

VOCAB, HIDDEN, BATCH, SEQ = 4096, 32, 4, 64
PLAN = {"tensor_parallel": {"lm_head": "colwise"}}


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        logits = self.lm_head(self.embed(input_ids))
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(0, 1))
        return {"loss": loss, "logits": logits}


def _batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels[torch.rand(labels.shape, generator=g) < 0.2] = -100
    return {"input_ids": ids, "labels": labels}


def _head(disable: bool):
    torch.manual_seed(0)
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    return hp.parallelize(Head().to(torch.bfloat16), PLAN, mesh,
                          disable_passes=["inplace_reuse"] if disable else [])


def loss_peaks() -> dict:
    """The peak one step holds above the parameters, in units of one rank's fp32 logits, with the
    pass on and off (the second step of each: the first compiles)."""
    unit = BATCH * SEQ * VOCAB // dist.get_world_size() * 4
    peaks = {}
    for disable in (False, True):
        model = _head(disable)
        batch = _batch(1)
        model(**batch)["loss"].backward()
        model.zero_grad(set_to_none=True)
        with MemoryTracker(list(model.parameters())) as tracker:
            model(**batch)["loss"].backward()
        peaks["off" if disable else "on"] = (tracker.max_live / unit, tracker.peak_op)
    return peaks


def test_the_vocab_parallel_loss_holds_one_logits_buffer_less(dist2):
    """Out of place, the loss's backward holds the saved log-probabilities' exp, its product with
    the row sums and the nll gradient at once: 3 units (with the bf16 logits' 0.5 of forward
    below that). In place the exp and the product take the log-probabilities' storage: the peak
    is forward's 2.5 (bf16 logits, the fp32 copy shifted in place, its exp)."""
    peaks = dist2.run(loss_peaks)[0]
    on, off = peaks["on"][0], peaks["off"][0]
    assert off == pytest.approx(3.0, abs=0.05), peaks
    assert on == pytest.approx(2.5, abs=0.05), peaks


def on_and_off_agree(steps: int = 3) -> None:
    """The same training with the pass on and off: every loss and gradient bitwise equal, for
    the loss head (bf16) and, under FSDP x TP with bf16 mixed precision and the loss vocab-parallel,
    the example Llama and transformers' Llama (30% of the labels -100 in both)."""
    from hyper_parallel.models.hf_zoo import tiny_hf_model

    mesh = hp.init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    llama_plan = {**llama_tp_plan(loss_parallel=True),
                  "fully_shard": hp.FullyShard(units=("model.layers.*", ""), mixed_precision=policy)}

    def llama_case(reference):
        return (lambda disable: hp.parallelize(copy.deepcopy(reference), llama_plan, mesh,
                                               disable_passes=["inplace_reuse"] if disable else []),
                lambda step: local_batch(global_batch("llama", 4, 16, seed=step, ignore_fraction=0.3), mesh))

    cases = {
        "head": (lambda disable: _head(disable), lambda step: _batch(step)),
        "llama": llama_case(build_model("llama", num_hidden_layers=2)),
        "hf_llama": llama_case(tiny_hf_model("LlamaForCausalLM")),
    }
    for name, (make, batch_of) in cases.items():
        models = [make(False), make(True)]
        # The pass off is the reference here; both get this rank's batch; bitwise (rtol = atol = 0).
        ParityStepper(models[1], models[0], batch=batch_of, rtol=0.0, atol=0.0, what=name).run(steps)
        forward, backward = models[0].compiled_programs()
        changed = [n for gm in (forward, backward) for n in gm.graph.nodes if meta.INPLACE_OF in n.meta]
        assert changed, f"{name}: the pass rewrote nothing, so this compared nothing"


def test_turning_the_pass_off_changes_no_number(dist2):
    dist2.run(on_and_off_agree)


def retained_backward() -> None:
    """``backward(retain_graph=True)`` and a second backward over the same graph: the gradients are
    twice one backward's, so the second read the saved log-probabilities unchanged (the program
    that runs first under retain_graph writes into none of them)."""
    batch = _batch(3)
    once = _head(False)
    once(**batch)["loss"].backward()
    twice = _head(False)
    loss = twice(**batch)["loss"]
    loss.backward(retain_graph=True)
    loss.backward()
    for (name, a), b in zip(twice.named_parameters(), once.parameters()):
        torch.testing.assert_close(a.grad.full_tensor(), 2 * b.grad.full_tensor(), rtol=0, atol=0,
                                   msg=lambda m: f"{name}: {m}")
    # And the next plain backward of a new step writes into its saved tensors again.
    twice.zero_grad(set_to_none=True)
    twice(**batch)["loss"].backward()
    for (name, a), b in zip(twice.named_parameters(), once.parameters()):
        assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), name


def test_retain_graph_backward_twice(dist2):
    dist2.run(retained_backward)
