"""Unit tests for hyper_parallel.layout: Layout / TensorLayout, placement helpers, to_placements."""

import dataclasses

import pytest
import torch.distributed.tensor as dtensor

from hyper_parallel.layout import (
    Layout,
    Partial,
    Placement,
    Replicate,
    Shard,
    TensorLayout,
    format_placements,
    normalize_placements,
    parse_placement,
    to_placements,
)

MESH = ("dp", "tp")


@pytest.fixture
def layout():
    return Layout((2, 4), MESH)


# -- placements -------------------------------------------------------------------------------


def test_placements_are_torch_classes_with_short_text():
    assert Shard is dtensor.Shard and Replicate is dtensor.Replicate and Partial is dtensor.Partial
    assert isinstance(Shard(0), Placement)
    assert (str(Shard(0)), str(Replicate()), str(Partial())) == ("S(0)", "R", "P(sum)")


def test_format_placements():
    assert format_placements((Shard(0), Replicate())) == "[S(0), R]"
    assert format_placements([Partial("avg"), None]) == "[P(avg), -]"
    assert format_placements(()) == "[]"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("S(0)", Shard(0)),
        ("S(-1)", Shard(-1)),
        ("Shard(2)", Shard(2)),
        ("Shard(dim=1)", Shard(1)),
        ("R", Replicate()),
        ("Replicate()", Replicate()),
        ("P", Partial()),
        ("P(avg)", Partial("avg")),
        ("Partial(max)", Partial("max")),
    ],
)
def test_parse_placement(text, expected):
    assert parse_placement(text) == expected


def test_parse_placement_passes_objects_through_and_rejects_junk():
    p = Shard(3)
    assert parse_placement(p) is p
    for bad in ("S", "S(x)", "Q(0)", "P(prod)", 3):
        with pytest.raises(ValueError, match=r"cannot read .* as a placement.*S\(<dim>\)"):
            parse_placement(bad)


def test_normalize_placements():
    assert normalize_placements((Shard(-1), Replicate()), 3) == (Shard(2), Replicate())
    assert normalize_placements((Shard(1), Partial()), 2) == (Shard(1), Partial())
    with pytest.raises(ValueError, match=r"weight: placement S\(2\).*dim 2 but the tensor has 2 dims"):
        normalize_placements((Shard(2),), 2, "weight")
    with pytest.raises(ValueError, match=r"dim -3"):
        normalize_placements((Shard(-3),), 2)


# -- Layout -----------------------------------------------------------------------------------


def test_layout_value(layout):
    assert layout.mesh_shape == (2, 4) and layout.mesh_dim_names == MESH
    assert layout.ndim == 2 and layout.axis_size("tp") == 4
    assert repr(layout) == "Layout((2, 4), ('dp', 'tp'))"
    assert Layout([2, 4], ["dp", "tp"]) == layout  # lists are normalised
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.mesh_shape = (8,)
    with pytest.raises(ValueError, match=r"mesh axis 'pp' does not exist.*\['dp', 'tp'\]"):
        layout.axis_size("pp")


def test_layout_validation():
    with pytest.raises(ValueError, match=r"2 names but mesh_shape \(2,\) has 1 axes"):
        Layout((2,), ("dp", "tp"))
    with pytest.raises(ValueError, match=r"repeats \['tp'\].*unique"):
        Layout((2, 2), ("tp", "tp"))
    with pytest.raises(ValueError, match="positive ints"):
        Layout((0, 2), MESH)
    with pytest.raises(ValueError, match="needs mesh_dim_names"):
        Layout((2,), None)
    assert Layout((2, 2), MESH, rank_list=[3, 2, 1, 0]).rank_list == (3, 2, 1, 0)
    with pytest.raises(ValueError, match="rank_list .* 4 distinct ranks"):
        Layout((2, 2), MESH, rank_list=(0, 1, 2))
    with pytest.raises(ValueError, match="4 distinct ranks"):
        Layout((2, 2), MESH, rank_list=(0, 0, 1, 2))


def test_layout_call_builds_tensor_layout(layout):
    tl = layout("dp", "None")
    assert isinstance(tl, TensorLayout)
    assert tl.tensor_map == (("dp",), None)
    assert tl.partial == {}
    assert tl.ndim == 2
    assert layout(("dp", "tp"), None).tensor_map == (("dp", "tp"), None)
    assert layout(["tp"], "none").tensor_map == (("tp",), None)
    assert layout().tensor_map == ()


def test_tensor_layout_placements(layout):
    assert layout("dp", "None").placements() == (Shard(0), Replicate())
    assert layout("None", "tp").placements() == (Replicate(), Shard(1))
    assert layout("tp", "dp").placements() == (Shard(1), Shard(0))
    assert layout(("dp", "tp"), "None").placements() == (Shard(0), Shard(0))
    assert layout(None, None, ("dp", "tp")).placements(4) == (Shard(2), Shard(2))
    # An empty layout is fully replicated for a tensor of any rank.
    assert layout().placements() == (Replicate(), Replicate())
    assert layout().placements(5) == (Replicate(), Replicate())
    # Trailing dims the layout does not name are not sharded.
    assert layout("dp").placements(3) == (Shard(0), Replicate())


def test_tensor_layout_ndim_check(layout):
    with pytest.raises(ValueError, match=r"Layout\[dp, tp\]: the layout names 2 tensor dims but the tensor has 1 dims"):
        layout("dp", "tp").placements(1)


def test_tensor_layout_unknown_axis(layout):
    with pytest.raises(ValueError, match=r"Layout\[dp, sp\]: mesh axis 'sp' \(tensor dim 1\) does not exist; available axes are \['dp', 'tp'\]"):
        layout("dp", "sp")


def test_tensor_layout_axis_used_twice(layout):
    with pytest.raises(ValueError, match=r"mesh axis 'tp' is used twice \(tensor dims 0 and 1\)"):
        layout("tp", "tp")
    with pytest.raises(ValueError, match="used twice"):
        layout(("dp", "tp"), "tp")


def test_tensor_layout_inner_axis_first_needs_strided_shard(layout):
    with pytest.raises(ValueError, match=r"not mesh order.*strided shard.*not supported.*Reorder.*\('dp', 'tp'\)"):
        layout(("tp", "dp"), "None")


def test_tensor_layout_bad_entry(layout):
    with pytest.raises(TypeError, match="a tensor dim must be an axis name.*got 3"):
        layout(3)
    with pytest.raises(TypeError, match="got \\(\\)"):
        layout(())
    with pytest.raises(TypeError, match="a tensor dim must be"):
        layout(("dp", "None"))


def test_tensor_layout_partial(layout):
    base = layout("dp", "None")
    partial = base.with_partial("tp")
    assert base.partial == {}  # with_partial returns a new value
    assert partial.partial == {"tp": "sum"}
    assert partial.placements() == (Shard(0), Partial("sum"))
    assert layout().with_partial("dp", "avg").placements() == (Partial("avg"), Replicate())
    assert partial != base
    with pytest.raises(ValueError, match="mesh axis 'dp' both shards tensor dim 0 and is partial"):
        base.with_partial("dp")
    with pytest.raises(ValueError, match=r"partial mesh axis 'pp' does not exist.*\['dp', 'tp'\]"):
        base.with_partial("pp")
    with pytest.raises(ValueError, match=r"reduce op 'prod' on axis 'tp' is not one of"):
        base.with_partial("tp", "prod")


def test_tensor_layout_is_a_frozen_hashable_value(layout):
    a, b = layout("dp", "None"), layout("dp", None)
    assert a == b and hash(a) == hash(b)
    assert len({a, b, layout("tp")}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.tensor_map = ()


def test_tensor_layout_repr(layout):
    assert repr(layout("dp", "None")) == "Layout[dp, None]"
    assert repr(layout(("dp", "tp"), "None")) == "Layout[(dp, tp), None]"
    assert repr(layout()) == "Layout[]"
    assert repr(layout("dp").with_partial("tp")) == "Layout[dp; P(sum)@tp]"


# -- to_placements ----------------------------------------------------------------------------


def test_to_placements_tensor_layout(layout):
    assert to_placements(layout("None", "tp"), MESH) == (Replicate(), Shard(1))
    assert to_placements(layout("None", "tp"), MESH, ndim=2, mesh_shape=(2, 4)) == (Replicate(), Shard(1))


def test_to_placements_tensor_layout_for_another_mesh(layout):
    with pytest.raises(ValueError, match=r"w: Layout\[tp\] was built for mesh \('dp', 'tp'\).*but the mesh is \('dp', 'cp'\)"):
        to_placements(layout("tp"), ("dp", "cp"), where="w")
    with pytest.raises(ValueError, match=r"of shape \(2, 4\) but the mesh is \('dp', 'tp'\) of shape \(4, 2\)"):
        to_placements(layout("tp"), MESH, mesh_shape=(4, 2))


def test_to_placements_single_placement():
    assert to_placements(Shard(0), ("tp",)) == (Shard(0),)
    assert to_placements(Shard(-1), MESH, ndim=3, axis="tp") == (Replicate(), Shard(2))
    assert to_placements("S(1)", ("tp",)) == (Shard(1),)
    with pytest.raises(ValueError, match=r"x: a single placement S\(0\) is ambiguous on mesh \('dp', 'tp'\).*\[S\(0\), R\]"):
        to_placements(Shard(0), MESH, where="x")
    with pytest.raises(ValueError, match=r"mesh axis 'pp' does not exist.*\['dp', 'tp'\]"):
        to_placements(Shard(0), MESH, axis="pp")


def test_to_placements_per_axis_sequence():
    assert to_placements((Shard(0), Replicate()), MESH) == (Shard(0), Replicate())
    assert to_placements([Replicate(), Partial()], MESH) == (Replicate(), Partial())
    assert to_placements(["S(0)", "R"], MESH) == (Shard(0), Replicate())
    assert to_placements((Replicate(), Shard(-1)), MESH, ndim=2) == (Replicate(), Shard(1))
    with pytest.raises(ValueError, match=r"\[S\(0\)\] has 1 placements but the mesh \('dp', 'tp'\) has 2 axes"):
        to_placements((Shard(0),), MESH)


def test_to_placements_per_dim_yaml_form():
    assert to_placements(["tp", None], MESH) == (Replicate(), Shard(0))
    assert to_placements(("None", "dp"), MESH) == (Shard(1), Replicate())
    assert to_placements([["dp", "tp"]], MESH) == (Shard(0), Shard(0))
    assert to_placements([], MESH) == (Replicate(), Replicate())
    assert to_placements([None, None], MESH) == (Replicate(), Replicate())
    with pytest.raises(ValueError, match=r"key Layout\[sp, None\]: mesh axis 'sp' \(tensor dim 0\) does not exist; available axes are \['dp', 'tp'\]"):
        to_placements(["sp", None], MESH, where="key")
    with pytest.raises(ValueError, match="strided shard"):
        to_placements([("tp", "dp")], MESH)
    with pytest.raises(ValueError, match="names 2 tensor dims but the tensor has 1 dims"):
        to_placements(["tp", None], MESH, ndim=1)


def test_to_placements_dict_form():
    assert to_placements({"tp": Shard(1)}, MESH) == (Replicate(), Shard(1))
    assert to_placements({"dp": "S(0)", "tp": "P(sum)"}, MESH) == (Shard(0), Partial())
    with pytest.raises(ValueError, match=r"mesh axis 'cp' .* does not exist; available axes are \['dp', 'tp'\]"):
        to_placements({"cp": Shard(0)}, MESH)


def test_to_placements_rejects_other_things():
    with pytest.raises(TypeError, match="not a mix"):
        to_placements([Shard(0), "tp"], MESH)
    with pytest.raises(TypeError, match=r"cannot read the string 'tp' as a layout.*\['tp', None\]"):
        to_placements("tp", MESH)
    with pytest.raises(TypeError, match=r"cannot read 3 \(type int\) as a layout"):
        to_placements(3, MESH)
    with pytest.raises(TypeError, match=r"cannot read None"):
        to_placements(None, MESH)
