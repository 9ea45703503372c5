"""The ``causal_mask`` rewrite (propagation/causal_mask.py): attention reading a constant causal
mask computes with ``is_causal=True`` and no mask; every other mask stays as captured."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hyper_parallel.compile.capture import capture
from hyper_parallel.cp.attention_ops import ATTENTION_OPS, family_of
from hyper_parallel.ir import meta
from hyper_parallel.passes import check_disabled_passes
from hyper_parallel.propagation import causal_mask, mask_evaluation
from hyper_parallel.testing.parity import build_model

SEQ = 8


class MaskedAttention(nn.Module):
    """One attention over a mask ``make_mask(seq)`` builds inside forward, or over ``mask`` when
    the caller passes one."""

    def __init__(self, make_mask=None):
        super().__init__()
        self.proj = nn.Linear(12, 12)
        self.make_mask = make_mask

    def forward(self, x, mask=None):
        q = k = v = self.proj(x).view(x.shape[0], x.shape[1], 3, 4).transpose(1, 2)
        if mask is None:
            mask = self.make_mask(x.shape[1])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()


def _additive(keep: torch.Tensor, hidden: float = float("-inf")) -> torch.Tensor:
    return torch.zeros(keep.shape).masked_fill(~keep, hidden)


def _tril(s: int) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool).tril()


MASKS = {  # name: (the mask for a sequence length, what the rewrite makes of it)
    "additive -inf": (lambda s: _additive(_tril(s)), "causal"),
    "additive finfo.min": (lambda s: _additive(_tril(s), torch.finfo(torch.float32).min), "causal"),
    "boolean": (_tril, "causal"),
    "triu -inf": (lambda s: torch.full((s, s), float("-inf")).triu(1), "causal"),
    "zeros": (lambda s: torch.zeros(s, s), "unmasked"),
    "all True": (lambda s: torch.ones(s, s, dtype=torch.bool), "unmasked"),
    "sliding window": (lambda s: _additive(_tril(s) & ~_tril(s).tril(-3)), None),
    "shifted diagonal": (lambda s: _additive(torch.ones(s, s, dtype=torch.bool).tril(1)), None),
    "non-zero bias": (lambda s: _additive(_tril(s)) + 0.5, None),
    "constant bias": (lambda s: torch.full((s, s), 0.5), None),
}


def _attention_nodes(gm) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target in ATTENTION_OPS]


def _bound(node):
    return family_of(node.target).bind(node.target, node.args, node.kwargs)


def _captured(model, *args):
    return capture(model, args, {})


@pytest.mark.parametrize("name", list(MASKS))
def test_constant_masks(name):
    """Every attention node (forward and backward) loses its constant mask exactly when the mask
    is the one-device causal one (then ``is_causal``) or hides nothing, and the mask's
    computation goes with it."""
    make_mask, kind = MASKS[name]
    captured = _captured(MaskedAttention(make_mask), torch.randn(2, SEQ, 12))
    rewritten = causal_mask.make_constant_causal_masks_causal(captured.gm)
    nodes = _attention_nodes(captured.gm)
    assert len(nodes) == 2
    assert [_bound(n).is_causal for n in nodes] == [kind == "causal"] * 2
    assert [_bound(n).mask is None for n in nodes] == [kind is not None] * 2
    assert rewritten == ([f"{nodes[0].name} ({kind})"] if kind else [])
    if kind:  # nothing computes a [seq, seq] value any more
        squares = [n for n in captured.gm.graph.nodes
                   if isinstance(n.meta.get("val"), torch.Tensor) and tuple(n.meta["val"].shape[-2:]) == (SEQ, SEQ)]
        assert squares == []


def test_the_rewritten_program_computes_what_the_mask_did():
    captured = _captured(MaskedAttention(MASKS["additive -inf"][0]), torch.randn(2, SEQ, 12))
    before = captured.gm.code
    params = [p.detach().clone() for p in MaskedAttention().parameters()]
    x = torch.randn(2, SEQ, 12)
    inputs = ([*params, x], [torch.ones(())])  # (primals, tangents)
    expected = captured.gm(*inputs)
    causal_mask.make_constant_causal_masks_causal(captured.gm)
    assert captured.gm.code != before
    for got, want in zip(captured.gm(*inputs), expected):
        torch.testing.assert_close(got, want)


def test_a_mask_from_an_input_is_kept():
    captured = _captured(MaskedAttention(), torch.randn(2, SEQ, 12), _additive(_tril(SEQ)))
    assert causal_mask.make_constant_causal_masks_causal(captured.gm) == []
    assert all(_bound(n).mask is not None for n in _attention_nodes(captured.gm))


def test_transformers_causal_mask_becomes_is_causal():
    """transformers builds its mask from ``arange``s under export: the rewrite recognises it."""
    model = build_model("hf:LlamaForCausalLM", num_hidden_layers=2)
    ids = torch.randint(0, 100, (2, SEQ))
    captured = capture(model, (), {"input_ids": ids, "labels": ids})
    assert all(_bound(n).mask is not None for n in _attention_nodes(captured.gm))
    assert len(causal_mask.make_constant_causal_masks_causal(captured.gm)) == 2
    nodes = _attention_nodes(captured.gm)
    assert len(nodes) == 4 and all(_bound(n).is_causal and _bound(n).mask is None for n in nodes)


def test_transformers_encoder_mask_without_padding_goes():
    """BERT without an attention mask: transformers' bidirectional mask hides nothing."""
    model = build_model("hf:BertForMaskedLM", num_hidden_layers=1)
    ids = torch.randint(0, 100, (2, SEQ))
    captured = capture(model, (), {"input_ids": ids, "labels": ids})
    (rewritten,) = causal_mask.make_constant_causal_masks_causal(captured.gm)
    assert rewritten.endswith("(unmasked)")
    assert all(not _bound(n).is_causal and _bound(n).mask is None for n in _attention_nodes(captured.gm))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_padding_mask_is_kept_and_known_within_causal(dtype):
    """A padding ``attention_mask`` makes the mask depend on an input: kept. It is transformers'
    causal mask and'ed with the padding, so it hides every key after its query: both attention
    nodes are marked for ring attention to skip those blocks (also in bf16, where the additive
    mask is bf16)."""
    model = build_model("hf:LlamaForCausalLM", num_hidden_layers=1).to(dtype)
    ids = torch.randint(0, 100, (2, SEQ))
    padding = torch.ones(2, SEQ, dtype=torch.long)
    padding[1, :3] = 0
    captured = capture(model, (), {"input_ids": ids, "attention_mask": padding, "labels": ids})
    (marked,) = causal_mask.make_constant_causal_masks_causal(captured.gm)
    assert marked.endswith("(mask within causal)"), marked
    nodes = _attention_nodes(captured.gm)
    assert len(nodes) == 2 and all(_bound(n).mask is not None and not _bound(n).is_causal for n in nodes)
    assert all(n.meta.get(meta.MASK_WITHIN_CAUSAL) for n in nodes)


class PaddedAttention(MaskedAttention):
    """Attention over a constant ``make_mask(seq)`` and'ed with a per-key padding input."""

    def forward(self, x, keep):
        return super().forward(x, self.make_mask(x.shape[1]) & keep[:, None, None, :])


@pytest.mark.parametrize("make_mask,within", [
    (_tril, True),  # causal & padding
    (lambda s: _tril(s) & ~_tril(s).tril(-3), True),  # a sliding window inside the causal mask
    (lambda s: torch.ones(s, s, dtype=torch.bool), False),  # bidirectional & padding: later keys seen
    (lambda s: torch.ones(s, s, dtype=torch.bool).tril(1), False),  # each query sees the next key
])
def test_masks_within_causal_are_marked(make_mask, within):
    keep = torch.ones(2, SEQ, dtype=torch.bool)
    keep[1, :2] = False
    captured = _captured(PaddedAttention(make_mask), torch.randn(2, SEQ, 12), keep)
    marked = causal_mask.make_constant_causal_masks_causal(captured.gm)
    nodes = _attention_nodes(captured.gm)
    assert [n.meta.get(meta.MASK_WITHIN_CAUSAL, False) for n in nodes] == [within] * 2
    assert len(marked) == int(within) and all(_bound(n).mask is not None for n in nodes)


def test_transformers_encoder_padding_mask_is_not_within_causal():
    """BERT with padding: a bidirectional mask and'ed with padding lets queries see later keys."""
    model = build_model("hf:BertForMaskedLM", num_hidden_layers=1)
    ids = torch.randint(0, 100, (2, SEQ))
    padding = torch.ones(2, SEQ, dtype=torch.long)
    padding[1, :3] = 0
    captured = capture(model, (), {"input_ids": ids, "attention_mask": padding, "labels": ids})
    assert causal_mask.make_constant_causal_masks_causal(captured.gm) == []
    assert not any(n.meta.get(meta.MASK_WITHIN_CAUSAL) for n in _attention_nodes(captured.gm))


def test_a_mask_too_large_to_check_is_kept(monkeypatch, caplog):
    monkeypatch.setattr(causal_mask, "MAX_CHECKED_ELEMENTS", SEQ * SEQ - 1)
    captured = _captured(MaskedAttention(MASKS["additive -inf"][0]), torch.randn(2, SEQ, 12))
    with caplog.at_level(logging.INFO, logger=causal_mask.__name__):
        assert causal_mask.make_constant_causal_masks_causal(captured.gm) == []
    assert "is a constant of the program, but has 64 distinct entries" in caplog.text


def test_a_mask_an_op_must_compute_whole_past_the_budget_is_kept(monkeypatch):
    """``triu`` is no pointwise op: past ``MAX_MATERIALIZED_ELEMENTS`` the evaluation gives up."""
    monkeypatch.setattr(mask_evaluation, "MAX_MATERIALIZED_ELEMENTS", SEQ * SEQ - 1)
    captured = _captured(MaskedAttention(MASKS["triu -inf"][0]), torch.randn(2, SEQ, 12))
    assert causal_mask.make_constant_causal_masks_causal(captured.gm) == []


def test_the_rewrite_can_be_disabled_by_name():
    check_disabled_passes(["causal_mask"])
    with pytest.raises(ValueError, match="causal_mask"):
        check_disabled_passes(["no_such_pass"])


def _from_positions(keep):
    """An additive mask ``keep(i, j)`` built from ``arange``s, as transformers builds its own."""
    def make(s):
        i, j = torch.arange(s).unsqueeze(-1), torch.arange(s)
        return torch.where(keep(i, j), 0.0, float("-inf"))
    return make


@pytest.mark.parametrize("keep,causal,within", [
    (lambda i, j: j <= i, True, False),
    (lambda i, j: (j <= i) & (j > i - 3), False, True),  # sliding window: kept, within causal
    (lambda i, j: j <= i + 1, False, False),
    (lambda i, j: (j <= i) | (i == 5), False, False),  # one row sees every key
])
def test_masks_checked_a_block_of_rows_at_a_time(monkeypatch, keep, causal, within):
    """With budgets that hold no ``[seq, seq]`` value whole, the mask is computed lazily, a few
    query rows at a time: the same decisions (made causal; or kept, and marked when it hides
    every key after its query)."""
    monkeypatch.setattr(mask_evaluation, "LAZY_ABOVE_ELEMENTS", SEQ)
    monkeypatch.setattr(mask_evaluation, "ROW_BLOCK_ELEMENTS", 2 * SEQ)
    captured = _captured(MaskedAttention(_from_positions(keep)), torch.randn(2, SEQ, 12))
    mask = _bound(_attention_nodes(captured.gm)[0]).mask
    assert isinstance(mask_evaluation.evaluate(captured.gm, mask_evaluation.constant_ancestors(mask)),
                      mask_evaluation.Lazy)
    names = causal_mask.make_constant_causal_masks_causal(captured.gm)
    assert [n.rsplit(" (", 1)[1] for n in names] == ["causal)"] * causal + ["mask within causal)"] * within


def test_transformers_mask_is_held_without_its_batch_and_checked_by_rows(monkeypatch):
    """transformers' mask is the same for every batch row: held once, checked lazily by rows."""
    monkeypatch.setattr(mask_evaluation, "LAZY_ABOVE_ELEMENTS", 6 * SEQ)
    monkeypatch.setattr(mask_evaluation, "ROW_BLOCK_ELEMENTS", 3 * SEQ)
    model = build_model("hf:LlamaForCausalLM", num_hidden_layers=1)
    ids = torch.randint(0, 100, (4, SEQ))
    captured = capture(model, (), {"input_ids": ids, "labels": ids})
    mask = _bound(_attention_nodes(captured.gm)[0]).mask
    value = mask_evaluation.evaluate(captured.gm, mask_evaluation.constant_ancestors(mask))
    assert isinstance(value, mask_evaluation.Lazy) and mask_evaluation.shape_of(value) == (1, 1, SEQ, SEQ)
    assert len(causal_mask.make_constant_causal_masks_causal(captured.gm)) == 1


# --- packed sequences (propagation/packed_sequences.py) -------------------------------------------

PACKED_POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]])


def test_transformers_packed_sequence_mask_is_known_within_causal():
    """Position ids restarting at each document (packed sequences): transformers' mask depends on
    them, so it stays; its same-document and position-causal factors together hide every later
    key, so both attention nodes are marked."""
    model = build_model("hf:LlamaForCausalLM", num_hidden_layers=1)
    ids = torch.randint(0, 100, (2, SEQ))
    captured = capture(model, (), {"input_ids": ids, "position_ids": PACKED_POSITIONS, "labels": ids})
    (marked,) = causal_mask.make_constant_causal_masks_causal(captured.gm)
    assert marked.endswith("(mask within causal)"), marked
    nodes = _attention_nodes(captured.gm)
    assert len(nodes) == 2 and all(_bound(n).mask is not None for n in nodes)
    assert all(n.meta.get(meta.MASK_WITHIN_CAUSAL) for n in nodes)


class PackedAttention(MaskedAttention):
    """Attention over transformers' packed-sequence mask of ``positions`` (same document and
    ``P[k] <= P[q]``), or a variant of it: ``causal=False`` drops the position factor (documents
    attend both ways), ``flipped`` compares ``P[k] >= P[q]``, ``other_positions`` takes the
    position factor from a second input."""

    def __init__(self, causal=True, flipped=False, other_positions=False):
        super().__init__()
        self.causal, self.flipped, self.other_positions = causal, flipped, other_positions

    def forward(self, x, positions, other):
        b, s = positions.shape
        batch = torch.arange(b)[:, None, None, None]
        query, key = torch.arange(s)[None, None, :, None], torch.arange(s)[None, None, None, :]
        step = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
        documents = (step != 1).cumsum(-1)
        mask = documents[batch, query] == documents[batch, key]
        if self.causal:
            p = other if self.other_positions else positions
            mask = mask & ((p[batch, key] >= p[batch, query]) if self.flipped else (p[batch, key] <= p[batch, query]))
        return super().forward(x, mask)


@pytest.mark.parametrize("variant,within", [
    ({}, True),
    ({"causal": False}, False),  # documents attend both ways: later keys seen
    ({"flipped": True}, False),  # each query sees the later keys of its document
    ({"other_positions": True}, False),  # positions of another tensor prove nothing
])
def test_packed_sequence_masks(variant, within):
    captured = _captured(PackedAttention(**variant), torch.randn(2, SEQ, 12), PACKED_POSITIONS,
                         PACKED_POSITIONS.flip(-1))
    marked = causal_mask.make_constant_causal_masks_causal(captured.gm)
    nodes = _attention_nodes(captured.gm)
    assert [n.meta.get(meta.MASK_WITHIN_CAUSAL, False) for n in nodes] == [within] * 2
    assert len(marked) == int(within)
