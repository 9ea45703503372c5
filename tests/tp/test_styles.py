"""Unit tests for hyper_parallel.tp.styles: fields, defaults, reprs, resolve() and parse_style()."""

import dataclasses

import pytest
import torch
from torch import nn

from hyper_parallel.layout import Partial, Replicate, Shard
from hyper_parallel.tp.styles import (
    STYLE_NAMES,
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    StyleConstraints,
    parse_style,
)


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * self.weight


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(4, 8)
        self.down_proj = nn.Linear(8, 4)


def test_defaults_match_torch():
    assert ColwiseParallel() == ColwiseParallel(input_layouts=None, output_layouts=None, use_local_output=True)
    assert RowwiseParallel().use_local_output is True
    assert SequenceParallel().sequence_dim == 1 and SequenceParallel().use_local_output is False
    pmi = PrepareModuleInput()
    assert pmi.input_layouts is None and pmi.desired_input_layouts is None and pmi.use_local_output is False
    pmo = PrepareModuleOutput(output_layouts=Shard(0), desired_output_layouts=Replicate())
    assert pmo.use_local_output is True


def test_styles_are_frozen_keyword_only_values():
    style = ColwiseParallel(output_layouts=Replicate())
    assert isinstance(style, ParallelStyle)
    with pytest.raises(dataclasses.FrozenInstanceError):
        style.output_layouts = Shard(0)
    with pytest.raises(TypeError):
        ColwiseParallel(Replicate())  # keyword-only, like torch
    assert style == ColwiseParallel(output_layouts=Replicate())
    assert style != ColwiseParallel()


def test_short_reprs():
    assert repr(ColwiseParallel()) == "ColwiseParallel()"
    assert repr(RowwiseParallel(output_layouts=Shard(1))) == "RowwiseParallel(output_layouts=S(1))"
    assert repr(SequenceParallel(sequence_dim=0)) == "SequenceParallel(sequence_dim=0)"
    assert (
        repr(PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None)))
        == "PrepareModuleInput(input_layouts=[S(0), -], desired_input_layouts=[R, -])"
    )
    assert (
        repr(PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)))
        == "PrepareModuleOutput(output_layouts=[R], desired_output_layouts=[S(0)])"
    )


def test_placement_text_is_accepted():
    assert ColwiseParallel(output_layouts="R").output_layouts == Replicate()
    assert RowwiseParallel(input_layouts="S(-1)", output_layouts="S(1)") == RowwiseParallel(
        input_layouts=Shard(-1), output_layouts=Shard(1)
    )
    with pytest.raises(ValueError, match=r"ColwiseParallel\(output_layouts=...\): cannot read 'X' as a placement"):
        ColwiseParallel(output_layouts="X")


# -- ColwiseParallel / RowwiseParallel ----------------------------------------------------------


def test_colwise_linear():
    sc = ColwiseParallel().resolve("m.q_proj", nn.Linear(4, 8), "tp")
    assert isinstance(sc, StyleConstraints)
    assert sc.params == {"weight": Shard(0), "bias": Shard(0)}
    assert sc.inputs == (Replicate(),)
    assert sc.outputs == (Shard(-1),)
    assert sc.declared_inputs == (Replicate(),)
    assert sc.kwarg_inputs == {}


def test_colwise_linear_without_bias_and_custom_layouts():
    style = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    sc = style.resolve("lm_head", nn.Linear(4, 8, bias=False), "tp")
    assert sc.params == {"weight": Shard(0)}
    assert sc.inputs == (Replicate(),)  # what the matmul needs, whatever was declared
    assert sc.declared_inputs == (Shard(1),)
    assert sc.outputs == (Replicate(),)


def test_colwise_fused_parts():
    """``parts``: equal projections side by side (Phi-3's [q; k; v], [gate; up]), each split."""
    from hyper_parallel.compat import StridedShard

    sc = ColwiseParallel(parts=3).resolve("m.qkv_proj", nn.Linear(4, 24), "tp")
    assert sc.params == {"weight": StridedShard(0, split_factor=3), "bias": StridedShard(0, split_factor=3)}
    assert sc.inputs == (Replicate(),) and sc.outputs == (StridedShard(-1, split_factor=3),)
    assert repr(ColwiseParallel(parts=2)) == "ColwiseParallel(parts=2)"
    assert ColwiseParallel(parts=1).resolve("m", nn.Linear(4, 8), "tp") == ColwiseParallel().resolve("m", nn.Linear(4, 8), "tp")
    with pytest.raises(ValueError, match=r"'m.qkv_proj': its 16 output features are not 3 equal parts"):
        ColwiseParallel(parts=3).resolve("m.qkv_proj", nn.Linear(4, 16), "tp")
    with pytest.raises(TypeError, match=r"ColwiseParallel\(parts=2\) on 'embed': .* nn.Linear only, not Embedding"):
        ColwiseParallel(parts=2).resolve("embed", nn.Embedding(10, 4), "tp")
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="parts must be a positive int"):
            ColwiseParallel(parts=bad)


def test_colwise_embedding():
    sc = ColwiseParallel().resolve("embed", nn.Embedding(10, 4), "tp")
    assert sc.params == {"weight": Shard(1)}
    assert sc.inputs == (Replicate(),) and sc.outputs == (Shard(-1),)


def test_rowwise_linear():
    sc = RowwiseParallel().resolve("o_proj", nn.Linear(8, 4), "tp")
    assert sc.params == {"weight": Shard(1), "bias": Replicate()}
    assert sc.inputs == (Shard(-1),)
    assert sc.outputs == (Replicate(),)
    assert sc.declared_inputs == (Shard(-1),)
    assert RowwiseParallel().resolve("o", nn.Linear(8, 4, bias=False), "tp").params == {"weight": Shard(1)}
    assert RowwiseParallel(output_layouts=Shard(1)).resolve("o", nn.Linear(8, 4), "tp").outputs == (Shard(1),)


def test_rowwise_embedding():
    sc = RowwiseParallel(input_layouts=Replicate()).resolve("embed", nn.Embedding(10, 4), "tp")
    assert sc.params == {"weight": Shard(0)}
    assert sc.inputs == (Replicate(),)
    assert sc.outputs == (Replicate(),)
    assert sc.declared_inputs == (Replicate(),)


@pytest.mark.parametrize("style", [ColwiseParallel(), RowwiseParallel()])
def test_colwise_rowwise_reject_other_modules(style):
    name = type(style).__name__
    with pytest.raises(
        TypeError,
        match=rf"{name} cannot be applied to module 'model.layers.0.mlp' \(MLP\): it only shards "
        rf"nn.Linear, nn.Embedding and PEFT LoRA layers around an nn.Linear; apply {name} to its Linear/Embedding children instead, e.g. "
        r"'model.layers.0.mlp.gate_proj' or 'model.layers.0.mlp.down_proj'",
    ):
        style.resolve("model.layers.0.mlp", MLP(), "tp")


def test_colwise_on_module_without_linear_children():
    with pytest.raises(TypeError, match=r"'norm' \(RMSNorm\).*no Linear/Embedding children.*layouts="):
        ColwiseParallel().resolve("norm", RMSNorm(4), "tp")
    with pytest.raises(TypeError, match=r"module '<root module>' \(MLP\).*e.g. 'gate_proj'"):
        ColwiseParallel().resolve("", MLP(), "tp")


# -- SequenceParallel ---------------------------------------------------------------------------


def test_sequence_parallel():
    sc = SequenceParallel().resolve("model.norm", RMSNorm(4), "tp")
    assert sc.params == {"weight": Replicate()}
    assert sc.inputs == (Shard(1),) and sc.outputs == (Shard(1),)
    sc = SequenceParallel(sequence_dim=0).resolve("ln", nn.LayerNorm(4), "tp")
    assert sc.params == {"weight": Replicate(), "bias": Replicate()}
    assert sc.inputs == (Shard(0),) and sc.outputs == (Shard(0),)
    # Applies to any module; nested parameters keep their dotted local names.
    assert set(SequenceParallel().resolve("mlp", MLP(), "tp").params) == {
        "gate_proj.weight", "gate_proj.bias", "down_proj.weight", "down_proj.bias"
    }
    with pytest.raises(TypeError, match=r"sequence_dim=...\) must be an int, got '1'"):
        SequenceParallel(sequence_dim="1")


# -- Prepare* -----------------------------------------------------------------------------------


def test_prepare_module_input():
    style = PrepareModuleInput(
        input_layouts=(Shard(0), None),
        desired_input_layouts=(Replicate(), None),
        input_kwarg_layouts={"mask": Shard(0)},
        desired_input_kwarg_layouts={"mask": Replicate()},
    )
    sc = style.resolve("model.layers.0.self_attn", nn.Identity(), "tp")
    assert sc.params == {}
    assert sc.inputs == (Replicate(), None)
    assert sc.kwarg_inputs == {"mask": Replicate()}
    assert sc.declared_inputs == (Shard(0), None)
    assert sc.declared_kwarg_inputs == {"mask": Shard(0)}
    assert sc.outputs == ()


def test_prepare_module_input_normalises_and_validates():
    single = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts="R")
    assert single.input_layouts == (Shard(1),) and single.desired_input_layouts == (Replicate(),)
    assert PrepareModuleInput(desired_input_layouts=[Replicate()]).resolve("", nn.Identity(), "tp").inputs == (
        Replicate(),
    )
    assert PrepareModuleInput().resolve("", nn.Identity(), "tp") == StyleConstraints()
    with pytest.raises(ValueError, match=r"input_layouts \[S\(0\), R\] and desired_input_layouts \[R\] must have the same length"):
        PrepareModuleInput(input_layouts=(Shard(0), Replicate()), desired_input_layouts=Replicate())
    with pytest.raises(ValueError, match="desired_input_layouts None must have the same length"):
        PrepareModuleInput(input_layouts=Shard(0))
    with pytest.raises(ValueError, match=r"input_kwarg_layouts keys \['a'\] and desired_input_kwarg_layouts keys \['b'\]"):
        PrepareModuleInput(input_kwarg_layouts={"a": Shard(0)}, desired_input_kwarg_layouts={"b": Replicate()})
    with pytest.raises(TypeError, match="expected a Placement or a tuple"):
        PrepareModuleInput(desired_input_layouts=3)


def test_prepare_module_output():
    style = PrepareModuleOutput(output_layouts=(Replicate(), None), desired_output_layouts=(Shard(0), None))
    sc = style.resolve("m", nn.Identity(), "tp")
    assert sc.params == {} and sc.inputs == ()
    assert sc.outputs == (Shard(0), None)
    assert sc.declared_outputs == (Replicate(), None)
    with pytest.raises(ValueError, match="must both be given, with the same length"):
        PrepareModuleOutput(output_layouts=(Replicate(), Replicate()), desired_output_layouts=Shard(0))
    with pytest.raises(TypeError):
        PrepareModuleOutput(output_layouts=Replicate())  # desired_output_layouts is required


def test_prepare_module_input_output():
    style = PrepareModuleInputOutput(
        input_layouts=Shard(0),
        desired_input_layouts=Replicate(),
        output_layouts=Partial(),
        desired_output_layouts=Replicate(),
    )
    assert style.input_layouts == (Shard(0),) and style.output_layouts == (Partial(),)
    sc = style.resolve("m", nn.Identity(), "tp")
    assert sc.inputs == (Replicate(),) and sc.outputs == (Replicate(),)
    assert sc.declared_inputs == (Shard(0),) and sc.declared_outputs == (Partial(),)
    with pytest.raises(ValueError, match="same length"):
        PrepareModuleInputOutput(
            input_layouts=(Shard(0), Shard(0)), desired_input_layouts=Replicate(),
            output_layouts=Replicate(), desired_output_layouts=Replicate(),
        )


# -- parse_style --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, cls",
    [
        ("colwise", ColwiseParallel),
        ("rowwise", RowwiseParallel),
        ("sequence_parallel", SequenceParallel),
        ("sequence", SequenceParallel),
        ("ColwiseParallel", ColwiseParallel),
        ("RowwiseParallel", RowwiseParallel),
        ("SequenceParallel", SequenceParallel),
    ],
)
def test_parse_style_names(name, cls):
    assert parse_style(name) == cls()
    assert name in STYLE_NAMES


def test_parse_style_objects_and_dicts():
    style = RowwiseParallel(output_layouts=Shard(1))
    assert parse_style(style) is style
    assert parse_style({"style": "rowwise", "output_layouts": "S(1)"}) == style
    assert parse_style({"style": "sequence", "sequence_dim": 0}) == SequenceParallel(sequence_dim=0)
    assert parse_style(
        {"style": "PrepareModuleInput", "desired_input_layouts": ["R", None]}
    ) == PrepareModuleInput(desired_input_layouts=(Replicate(), None))


def test_parse_style_errors():
    with pytest.raises(ValueError, match=r"tensor_parallel\['x'\]: unknown parallel style 'colwize'; valid names are \['colwise', 'rowwise', 'sequence_parallel'"):
        parse_style("colwize", "tensor_parallel['x']")
    with pytest.raises(ValueError, match=r"unknown parallel style 'nope'; valid names are .*PrepareModuleInput"):
        parse_style({"style": "nope"})
    with pytest.raises(ValueError, match=r"ColwiseParallel has no field 'sequence_dim'; its fields are \['input_layouts'"):
        parse_style({"style": "colwise", "sequence_dim": 0})
    with pytest.raises(TypeError, match="expected a ParallelStyle, a style name"):
        parse_style(3)
