"""Eager DTensor calls (hyper_parallel.distributed.dtensor) on a 2x2 ("dp", "tp") mesh of 4 gloo ranks: every
local shard is checked against a manual chunking of the same seeded tensor."""

import pytest
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import hyper_parallel as hp
from hyper_parallel.distributed import dtensor as hpd


def _error(fn, *args) -> str:
    """The type and message of what ``fn(*args)`` raises ("" if it returns)."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return f"{type(exc).__name__}: {exc}"
    return ""


def _eager_calls() -> dict:
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    layout = hp.Layout((2, 2), ("dp", "tp"))
    dp, tp = mesh.get_coordinate()
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    full = torch.randn(4, 6)
    out: dict = {"coord": (dp, tp), "full": full, "no_mesh": _error(hpd.get_current_mesh)}

    with mesh:
        out["current_is_mesh"] = hpd.get_current_mesh() is mesh
        out["axis_sizes"] = (hpd.get_device_num_along_axis("dp"),
                             hpd.get_device_num_along_axis("tp"))
        d = hpd.distribute_tensor(full, layout("dp", "tp"))
        out["dist_2d"] = (type(d) is DTensor, d.placements, hpd.to_local(d))
        out["dist_both_axes"] = hpd.to_local(hpd.distribute_tensor(full, layout(("dp", "tp"))))
        out["dist_placements"] = hpd.to_local(hpd.distribute_tensor(full, (Replicate(), Shard(1))))

        # from_local + full_tensor round trip (layout form, torch argument order).
        local = full.chunk(2, 0)[dp].chunk(2, 1)[tp]
        out["round_trip"] = hpd.full_tensor(hpd.from_local(local, layout("dp", "tp")))
        torch_order = hpd.from_local(local, mesh, (Shard(0), Shard(1)))
        out["round_trip_torch_order"] = hpd.full_tensor(torch_order)

        out["redist_cols_dp"] = hpd.to_local(hpd.redistribute(d, layout("None", "dp")))
        out["redist_rows_tp"] = hpd.to_local(hpd.redistribute(d, (Replicate(), Shard(0))))
        out["redist_replicate"] = hpd.to_local(hpd.redistribute(d, layout()))

        # Each rank holds rank + 1 in its (2, 3) block: partial (sum) over tp, rows sharded on dp.
        p = hpd.from_local(torch.full((2, 3), float(rank + 1)), layout("dp").with_partial("tp"))
        reduced = hpd.reduce_partial(p)
        out["partial"] = (hpd.is_partial(p), p.placements, hpd.is_partial(reduced),
                          reduced.placements, hpd.to_local(reduced), hpd.full_tensor(p))
        out["not_partial_unchanged"] = hpd.reduce_partial(d) is d
        out["placements_partial"] = hpd.is_partial(
            hpd.from_local(torch.ones(2), (Replicate(), Partial("max")))
        )

        out["errors"] = {
            "axis": _error(hpd.get_device_num_along_axis, "pp"),
            "names": _error(hpd.from_local, local, hp.Layout((2, 2), ("dp", "ep"))("dp")),
            "shape": _error(hpd.redistribute, d, hp.Layout((4, 1), ("dp", "tp"))("dp")),
            "dict_axis": _error(hpd.redistribute, d, {"ep": Shard(0)}),
            "count": _error(hpd.distribute_tensor, full, (Shard(0),)),
            "not_dtensor": _error(hpd.is_partial, full),
        }
    out["explicit_mesh_axis"] = hpd.get_device_num_along_axis("tp", mesh)
    return out


@pytest.fixture(scope="module")
def results(dist4):
    return dist4.run(_eager_calls)


def test_distribute_from_local_redistribute_give_the_manual_slices(results):
    for r in results:
        full, (dp, tp) = r["full"], r["coord"]
        is_dtensor, placements, local = r["dist_2d"]
        assert is_dtensor and placements == (Shard(0), Shard(1))
        assert torch.equal(local, full.chunk(2, 0)[dp].chunk(2, 1)[tp])
        assert torch.equal(r["dist_both_axes"], full.chunk(4, 0)[2 * dp + tp])
        assert torch.equal(r["dist_placements"], full.chunk(2, 1)[tp])
        assert torch.equal(r["round_trip"], full)
        assert torch.equal(r["round_trip_torch_order"], full)
        assert torch.equal(r["redist_cols_dp"], full.chunk(2, 1)[dp])
        assert torch.equal(r["redist_rows_tp"], full.chunk(2, 0)[tp])
        assert torch.equal(r["redist_replicate"], full)
    assert len({tuple(r["coord"]) for r in results}) == 4  # every rank saw its own block


def test_partial_value_reduces_to_the_sum(results):
    for r in results:
        dp, _ = r["coord"]
        was, placements, still, reduced_placements, local, whole = r["partial"]
        assert was and not still and r["placements_partial"]
        assert placements == (Shard(0), Partial("sum"))
        assert reduced_placements == (Shard(0), Replicate())
        # The tp group of row dp is ranks 2*dp and 2*dp + 1, holding 2*dp + 1 and 2*dp + 2.
        assert torch.equal(local, torch.full((2, 3), float(4 * dp + 3)))
        assert torch.equal(whole, torch.cat([torch.full((2, 3), 3.0), torch.full((2, 3), 7.0)]))
        assert r["not_partial_unchanged"]


def test_current_mesh_and_axis_sizes(results):
    for r in results:
        assert r["current_is_mesh"]
        assert r["axis_sizes"] == (2, 2) and r["explicit_mesh_axis"] == 2
        assert r["no_mesh"].startswith("RuntimeError") and "with mesh:" in r["no_mesh"]


def test_error_messages_name_the_axis_and_the_valid_ones(results):
    errors = results[0]["errors"]
    assert errors["axis"].startswith("ValueError") and "'pp'" in errors["axis"]
    assert "['dp', 'tp']" in errors["axis"]
    assert errors["names"].startswith("ValueError") and "('dp', 'ep')" in errors["names"]
    assert "('dp', 'tp')" in errors["names"]
    assert errors["shape"].startswith("ValueError") and "(4, 1)" in errors["shape"]
    assert "(2, 2)" in errors["shape"]
    assert errors["dict_axis"].startswith("ValueError") and "'ep'" in errors["dict_axis"]
    assert "['dp', 'tp']" in errors["dict_axis"]
    assert errors["count"].startswith("ValueError") and "2 axes" in errors["count"]
    assert errors["not_dtensor"].startswith("TypeError") and "DTensor" in errors["not_dtensor"]
    assert all(r["errors"] == errors for r in results)
