"""The bucketing pass never fuses collectives into a cycle: a bucket whose members would depend on
each other once fused (directly, or through a bucket fused before it) is cut into parts."""

import operator
from types import SimpleNamespace

import pytest
import torch

from hyper_parallel.passes import PassContext
from hyper_parallel.passes.bucketing import _restore_topological_order, bucketing_pass
from hyper_parallel.testing.graph_builder import GraphBuilder

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
RS, AR, WAIT = c10d.reduce_scatter_tensor.default, c10d.all_reduce.default, c10d.wait_tensor.default
AR_INPLACE = c10d.all_reduce_.default


def _reduce(g, x, param, group, kind=RS):
    """One lowered gradient collective: ``kind`` over ``group`` (2 ranks) and its wait."""
    args = (x, "sum", 2, group) if kind is RS else (x, "sum", group)
    return g(WAIT, g(kind, *args, hp_grad_of=param, hp_role="redistribute"))


def _gpt2_like_gradients():
    """The shape GPT-2's column-parallel Conv1D made under FSDP x TP (block h.1): the ``qkv`` weight
    gradient is reduce-scattered over dp, re-laid out (split on dim 1, cat on dim 0), then over tp;
    the ``proj`` weight gradient over tp then dp; ``norm`` over dp only. All three belong to unit
    ``block``, so the dp and tp reduce-scatters form one bucket each, and fusing the dp one puts
    qkv's tp reduce-scatter after it and proj's before it."""
    g = GraphBuilder()
    dq, dp, dn = g.input("d_qkv", 4, 8), g.input("d_proj", 4, 8), g.input("d_norm", 8)
    qkv = _reduce(g, dq, "block.qkv.weight", "dp")
    halves = g(aten.split.Tensor, qkv, 4, 1)
    qkv = _reduce(g, g(aten.cat.default, [g(operator.getitem, halves, 0), g(operator.getitem, halves, 1)]),
                  "block.qkv.weight", "tp")
    proj = _reduce(g, _reduce(g, dp, "block.proj.weight", "tp"), "block.proj.weight", "dp")
    norm = _reduce(g, dn, "block.norm.weight", "dp")
    return g.module(qkv, proj, norm)


def _ctx(units):
    return PassContext(fsdp=SimpleNamespace(unit_of=units, comm_fusion=True), gradient_bucket_bytes=1 << 20)


def _fused(gm):
    """``{hp_bucket label: (collective target, group, sorted parameters)}`` of the fused collectives."""
    out = {}
    for node in gm.graph.nodes:
        label = node.meta.get("hp_bucket")
        if label and node.target in (RS, AR, AR_INPLACE):
            out[label] = (node.target, node.args[-1], [])
    for node in gm.graph.nodes:
        if "hp_bucket" in node.meta and node.meta.get("hp_grad_of"):
            out[node.meta["hp_bucket"]][2].append(node.meta["hp_grad_of"])
    return {k: (t, grp, sorted(ps)) for k, (t, grp, ps) in out.items()}


def _assert_topological(gm):
    seen = set()
    for node in gm.graph.nodes:
        assert all(a in seen for a in node.all_input_nodes), f"{node.name} runs before one of its inputs"
        seen.add(node)
    gm.graph.lint()


def _run_twice(gm, ctx):
    gm = bucketing_pass(gm, ctx)
    _assert_topological(gm)
    code = gm.code
    again = bucketing_pass(gm, ctx)
    assert again.code == code  # idempotent: fused collectives are never candidates again
    return gm


def test_crossed_reduction_orders_split_the_second_bucket():
    gm = _run_twice(_gpt2_like_gradients(), _ctx({f"block.{p}.weight": "block" for p in ("qkv", "proj", "norm")}))
    # The dp bucket (first in graph order) fuses whole; the tp one would then both feed it (proj)
    # and read it (qkv), so each of its reduce-scatters becomes its own part, in graph order.
    assert _fused(gm) == {
        "block reduce_scatter (3 params)": (RS, "dp", ["block.norm.weight", "block.proj.weight", "block.qkv.weight"]),
        "block reduce_scatter (1 params, part 1/2)": (RS, "tp", ["block.qkv.weight"]),
        "block reduce_scatter (1 params, part 2/2)": (RS, "tp", ["block.proj.weight"]),
    }
    # Nothing is left unfused, and the data flow is the one described above.
    assert all("hp_bucket" in n.meta for n in gm.graph.find_nodes(op="call_function", target=RS))
    order = {n.meta["hp_bucket"]: i for i, n in enumerate(gm.graph.nodes) if n.target is RS}
    assert order["block reduce_scatter (1 params, part 2/2)"] < order["block reduce_scatter (3 params)"]
    assert order["block reduce_scatter (3 params)"] < order["block reduce_scatter (1 params, part 1/2)"]


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_bucket_straddling_a_dependency_is_cut(kind):
    """Two gradients of one bucket (same unit, op, group) where the second is computed from the
    first's reduced value: fused, the collective would read its own output. FSDP fuses each part
    (one parameter each); DDP, as for any bucket of one gradient, keeps the all-reduces as they are."""
    g = GraphBuilder()
    da, db = g.input("d_a", 4, 8), g.input("d_b", 4, 8)
    kind_op = RS if kind == "fsdp" else AR
    a = _reduce(g, da, "u.a", "dp", kind_op)
    b_in = g(aten.add.Tensor, db, a if kind == "ddp" else g(aten.repeat.default, a, [2, 1]))
    b = _reduce(g, b_in, "u.b", "dp", kind_op)
    gm = g.module(a, b)
    gm = _run_twice(gm, _ctx({"u.a": "u", "u.b": "u"} if kind == "fsdp" else {}))
    if kind == "fsdp":
        assert _fused(gm) == {"u reduce_scatter (1 params, part 1/2)": (RS, "dp", ["u.a"]),
                              "u reduce_scatter (1 params, part 2/2)": (RS, "dp", ["u.b"])}
    else:  # each part is one gradient, which keeps its own all-reduce (no copy into a buffer)
        assert _fused(gm) == {"gradient bucket 0 all_reduce (1 params, part 1/2)": (AR, "dp", ["u.a"]),
                              "gradient bucket 0 all_reduce (1 params, part 2/2)": (AR, "dp", ["u.b"])}
        assert len(gm.graph.find_nodes(op="call_function", target=AR)) == 2


def test_independent_buckets_fuse_whole():
    """No dependency: one fused reduce-scatter per unit and group, as before the cut existed."""
    g = GraphBuilder()
    outs = [_reduce(g, g.input(f"d_{p}", 4, 8), f"block.{p}", "dp") for p in ("x", "y")]
    outs.append(_reduce(g, g.input("d_z", 4, 8), "block.z", "tp"))
    gm = _run_twice(g.module(*outs), _ctx({"block.x": "block", "block.y": "block", "block.z": "block"}))
    assert _fused(gm) == {"block reduce_scatter (2 params)": (RS, "dp", ["block.x", "block.y"]),
                          "block reduce_scatter (1 params)": (RS, "tp", ["block.z"])}


def test_all_gather_parts_and_placement():
    """One unit's forward all-gathers: ``b`` gathers a value computed from ``a``'s gathered
    parameter (so they cannot share a collective), ``c`` one that only exists after ``a``'s first
    use and comes from a collective (so it cannot be copied earlier: the fused gather of ``a`` and
    ``c`` waits for it instead, and ``a``'s use moves after it)."""
    g = GraphBuilder()

    def gather(x, param):
        gathered = g(c10d.all_gather_into_tensor.default, x, 2, "dp", hp_fsdp_param=param, hp_fsdp_unit="u",
                     hp_role="redistribute")
        return g(aten.relu.default, g(WAIT, gathered))

    use_a = gather(g.input("a", 2, 4), "u.a")
    late = g(WAIT, g(AR, g.input("x", 2, 4), "sum", "tp"))
    use_c = gather(late, "u.c")
    use_b = gather(use_a, "u.b")
    gm = _run_twice(g.module(use_b, use_c), _ctx({}))
    gathers = gm.graph.find_nodes(op="call_function", target=c10d.all_gather_into_tensor.default)
    assert [n.meta["hp_bucket"] for n in gathers] == [
        "u forward all_gather (2 params, part 1/2)", "u forward all_gather (1 params, part 2/2)"]
    params = {n.meta["hp_fsdp_param"]: n.meta["hp_bucket"] for n in gm.graph.nodes if "hp_bucket" in n.meta
              and n.meta.get("hp_fsdp_param")}
    assert params == {"u.a": gathers[0].meta["hp_bucket"], "u.c": gathers[0].meta["hp_bucket"],
                      "u.b": gathers[1].meta["hp_bucket"]}
    assert len(gm.graph.find_nodes(op="call_function", target=AR)) == 1  # never copied
    # The copy-out of each gathered buffer (view, split, each parameter's reshape) is marked to stay
    # op by op, out of Inductor regions (codegen/regions.py): it runs right after the wait and frees
    # the buffer before the unit computes; the parameters' uses are not marked.
    for gather in gathers:
        copy_out, uses = _copy_out(next(iter(gather.users)))
        assert {n.target for n in copy_out} >= {aten.view.default, aten.split_with_sizes.default, aten.reshape.default}
        assert all(n.meta.get("hp_pack") for n in copy_out), gather.meta["hp_bucket"]
        assert uses and not any(n.meta.get("hp_pack") for n in uses)


def _copy_out(wait) -> tuple[list, list]:
    """The nodes copying parameters out of a gathered buffer (up to each parameter's value), and
    the first nodes using those parameters."""
    copying = {aten.view.default, aten.split_with_sizes.default, operator.getitem, aten.reshape.default,
               aten.clone.default}
    seen, uses, stack = [], [], list(wait.users)
    while stack:
        user = stack.pop()
        if user.target not in copying:
            uses.append(user)
        elif user not in seen:
            seen.append(user)
            stack.extend(user.users)
    return seen, uses


def test_a_cycle_is_a_readable_value_error():
    """The invariant's last line of defence: if fused collectives ever depend on each other, the
    user reads which buckets, parameters and nodes, and the workaround (not an AssertionError)."""
    g = GraphBuilder()
    x = g.input("x", 4, 8)
    first = g(RS, x, "sum", 2, "dp", hp_bucket="u reduce_scatter (2 params)")
    wait = g(WAIT, first, hp_bucket="u reduce_scatter (2 params)")
    out = g(aten.reshape.default, wait, [2, 8], hp_bucket="u reduce_scatter (2 params)", hp_grad_of="u.w")
    gm = g.module(out)
    back = g.graph.call_function(aten.add.Tensor, (x, out))
    first.args = (back, "sum", 2, "dp")  # out feeds first: a cycle
    with pytest.raises(ValueError) as info:
        _restore_topological_order(gm.graph)
    message = str(info.value)
    assert "bucketing produced a cycle" in message
    assert "['u reduce_scatter (2 params)']" in message and "['u.w']" in message
    # The loop, in data-flow order from its earliest node.
    assert f"{first.name} -> {wait.name} -> {out.name} -> {back.name} -> {first.name}." in message
    assert "disable_passes=['bucketing']" in message


def test_ddp_buckets_follow_backward_order_small_first_in_place():
    """DDP's buckets: gradients bucketed in the order backward computes them (lowering left their
    all-reduces at the end of backward, in parameter order), the first bucket small (one gradient
    here, as DDP's 1 MiB first bucket) so its all-reduce is issued right after that gradient, and a
    fused bucket reduced in place: one ``all_reduce_`` on the packed buffer, no second copy."""
    g = GraphBuilder()
    x = g.input("x", 4, 8)  # 128 bytes per gradient
    g1 = g(aten.mul.Tensor, x, x)
    g2 = g(aten.mul.Tensor, g1, x)
    g3 = g(aten.mul.Tensor, g2, x)
    outs = [_reduce(g, grad, f"w{i}", "dp", AR) for i, grad in ((3, g3), (1, g1), (2, g2))]
    ctx = PassContext(gradient_bucket_bytes=256, first_gradient_bucket_bytes=128)
    gm = _run_twice(g.module(*outs), ctx)
    assert _fused(gm) == {"gradient bucket 0 all_reduce (1 params)": (AR, "dp", ["w1"]),
                          "gradient bucket 1 all_reduce (2 params)": (AR_INPLACE, "dp", ["w2", "w3"])}
    (alone,) = gm.graph.find_nodes(op="call_function", target=AR)
    assert alone.prev is g1 and alone.next.target is WAIT  # issued right after its gradient
    (fused,) = gm.graph.find_nodes(op="call_function", target=AR_INPLACE)
    assert fused.args[0].target is aten.reshape.default and fused.args[0].args[0].target is aten.cat.default
    nodes = list(gm.graph.nodes)
    assert nodes.index(g3) < nodes.index(fused.args[0].args[0]) < nodes.index(fused)
    # Every gradient is read back from the reduced buffer (a view of it), not from a second buffer.
    waited = next(iter(fused.users))
    assert waited.target is WAIT and next(iter(waited.users)).target is aten.split_with_sizes.default


def test_mixed_precision_gradients_are_packed_in_their_dtype_and_cast_once():
    """bf16 gradients reduced in fp32: each unit's fused reduce-scatter reads one cast of the packed
    bf16 buffer, not a packed buffer of per-gradient fp32 copies (which kept every gradient's fp32
    copy alive beside the fp32 buffer). A cast is elementwise, so the values are the same. Under
    codegen="inductor" too: packing the fp32 copies there held the step's program at 1.23x its
    eager peak, and a kernel fusing a gradient with its cast stored the unrounded fp32 value where
    the single device rounds the gradient to bf16 first."""
    import dataclasses
    import functools

    import hyper_parallel as hp
    from hyper_parallel.testing.pass_inputs import LayerStack, copy_graph_module, pass_input

    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plan = {"fully_shard": hp.FullyShard(units=("layers.*", ""), mixed_precision=policy)}
    source, ctx = pass_input(functools.partial(LayerStack, 2), plan, 2, "bucketing")
    for codegen in ("eager", "inductor"):
        gm = bucketing_pass(copy_graph_module(source), dataclasses.replace(ctx, codegen=codegen))
        scatters = [n for n in gm.graph.nodes if n.target is RS]
        assert len(scatters) == 3  # layers.1, layers.0, the root
        for rs in scatters:
            cast = rs.args[0]
            assert cast.target is aten._to_copy.default and cast.kwargs == {"dtype": torch.float32}, (codegen, rs.meta["hp_bucket"])
            packed = cast.args[0].args[0]
            assert packed.target is aten.cat.default and packed.meta["val"].dtype == torch.bfloat16
            assert all(block.meta["val"].dtype == torch.bfloat16 for block in packed.args[0])
            # Each block is a gradient in bf16 (a reshape of it), not an fp32 copy of one.
            for block in packed.args[0]:
                assert block.target is aten.reshape.default and block.args[0].target is not aten._to_copy.default
