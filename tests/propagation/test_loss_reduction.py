"""The returned loss is the global per-token mean when ranks count different numbers of tokens.

Labels of -100 (padding, unmasked positions of a masked LM) make data-parallel ranks count
different numbers of tokens; the loss one device computes on the whole batch is the sum over all
counted tokens divided by their number, not the mean of the ranks' means. Every test compares the
loss and every gradient with the single-device run (run_parity asserts at each step).
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel.testing.parity import build_model, run_parity
from hyper_parallel.testing.stepper import ParityStepper, batches, call

PADDED = 0.3  # fraction of labels set to -100, plus a whole row (one rank may count none)


@pytest.mark.parametrize("plan", ["dp", "fsdp", "tp"])
def test_padded_labels_2_ranks(dist2, plan):
    names = ("tp",) if plan == "tp" else ("dp",)
    results = dist2.run(run_parity, "llama", plan, (2,), names, ignore_fraction=PADDED)
    assert results[0]["losses"] == results[1]["losses"]


def test_padded_labels_fsdp_tp_4_ranks(dist4):
    # A rank pair holds the fully padded row: its sum and count are 0 and the global mean is still exact.
    dist4.run(run_parity, "llama", "fsdp_tp", (2, 2), ("dp", "tp"), ignore_fraction=PADDED, steps=2)


def test_padded_labels_hf_llama_dp(dist2):
    pytest.importorskip("transformers")
    dist2.run(run_parity, "hf_llama", "dp", (2,), ("dp",), ignore_fraction=PADDED)


def test_padded_labels_pipeline(dist2):
    """Micro-batches count different numbers of tokens too: the step's loss and gradients are those
    of the whole batch's mean, not the mean of the micro-batches' means."""
    from hyper_parallel.testing.parity import run_pipeline_parity

    plan = {"pipeline": {"split_points": ["model.layers.2"], "schedule": "1F1B", "num_microbatches": 4}}
    dist2.run(run_pipeline_parity, plan, (2,), ("pp",), ignore_fraction=PADDED)


# --- a masked language model (transformers' BERT): ~15% of positions carry a label ------------------

def _tiny_bert(seed: int = 0):
    import transformers

    config = transformers.BertConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return transformers.BertForMaskedLM(config)


def _masked_batch(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(5, 256, (4, 16), generator=g)
    masked = torch.rand(ids.shape, generator=g) < 0.15
    masked[0, :4] = True  # rank 0 counts more masked tokens than rank 1
    labels = ids.masked_fill(~masked, -100)
    return {"input_ids": ids.masked_fill(masked, 4), "labels": labels}  # 4: the [MASK] id here


def masked_lm_parity(plan, steps=3):
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    reference = _tiny_bert()
    parallel = hp.parallelize(copy.deepcopy(reference), plan, mesh)
    counts = []
    ParityStepper(reference, parallel, mesh=mesh, batch=_masked_batch,
                  before_step=lambda r: counts.append(int((r.local[0]["labels"] != -100).sum()))).run(steps)
    return counts


@pytest.mark.parametrize("plan", [{}, {"fully_shard": {"units": ["bert.encoder.layer.*", ""]}}], ids=["dp", "fsdp"])
def test_masked_lm_unequal_masked_counts(dist2, plan):
    pytest.importorskip("transformers")
    counts = dist2.run(masked_lm_parity, plan)
    assert counts[0] != counts[1], counts  # the case the test is about: ranks count differently


# --- loss variants: class weights, label smoothing -------------------------------------------------

class _Classifier(nn.Module):
    """Token classifier whose loss uses F.cross_entropy's options."""

    def __init__(self, weighted: bool, smoothing: float):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 8)
        self.register_buffer("class_weight", torch.linspace(0.5, 2.0, 8) if weighted else None)
        self.smoothing = smoothing

    def forward(self, input_ids, labels):
        logits = self.head(torch.tanh(self.embed(input_ids)))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), weight=self.class_weight,
                               label_smoothing=self.smoothing)


def classifier_parity(weighted: bool, smoothing: float, steps=3):
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    reference = _Classifier(weighted, smoothing)
    parallel = hp.parallelize(copy.deepcopy(reference), {}, mesh)

    def batch(step):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 64, (4, 8), generator=g)
        labels = torch.randint(0, 8, (4, 8), generator=g)
        labels[:2, : 2 + step] = -100
        labels[3] = -100
        return {"input_ids": ids, "labels": labels}

    ParityStepper(reference, parallel, mesh=mesh, batch=batch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5)).run(steps)


@pytest.mark.parametrize("weighted,smoothing", [(True, 0.0), (False, 0.1), (True, 0.1)],
                         ids=["class-weights", "label-smoothing", "both"])
def test_cross_entropy_options(dist2, weighted, smoothing):
    dist2.run(classifier_parity, weighted, smoothing)


# --- gradient accumulation: the step's loss is the mean over all its micro-batches' tokens ---------

def accumulation_parity(plan, micro_steps=2, steps=2, model="llama"):
    """HF's recipe: each micro-batch's summed loss is divided by the token count of the whole step
    (``num_items_in_batch``, over every micro-batch and rank); the micro-steps' losses then add up
    to one device's mean over the step's whole batch, and so do the gradients."""
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    reference = build_model(model)
    parallel = hp.parallelize(copy.deepcopy(reference), plan, mesh)

    def count():  # tokens of the whole step (shifted labels)
        return (stepper.current.batch["labels"][:, 1:] != -100).sum()

    def sync_last(record, i):  # FSDP: reduce once, at the last micro-step
        if "fully_shard" in plan:
            parallel.set_requires_gradient_sync(i == micro_steps - 1)

    # Consecutive micro-batches, each loss already over the step's tokens (not divided again), their
    # sum against one large batch; the loss and every gradient.
    stepper = ParityStepper(reference, parallel, mesh=mesh,
                            batch=batches(model, batch=4 * micro_steps, ignore_fraction=PADDED),
                            micro_batches=micro_steps, reference_micro_batches=1, scale_micro_losses=False,
                            forward=lambda m, b: m(**b, num_items_in_batch=count()), ref_forward=call,
                            micro_context=sync_last)
    stepper.run(steps)


@pytest.mark.parametrize("plan", [{}, {"fully_shard": {"units": ["model.layers.*", ""]}}], ids=["dp", "fsdp"])
def test_gradient_accumulation_global_token_mean(dist2, plan):
    dist2.run(accumulation_parity, plan)


def test_gradient_accumulation_hf_num_items_in_batch(dist2):
    """transformers' own path: LlamaForCausalLM passes num_items_in_batch to its loss function."""
    pytest.importorskip("transformers")
    dist2.run(accumulation_parity, {}, model="hf_llama", steps=1)
