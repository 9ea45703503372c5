"""The inplace_reuse pass: an elementwise op writes into an operand only where nothing reads that
storage afterwards, and the program computes the same values."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from hyper_parallel.ir import meta
from hyper_parallel.passes.context import PassContext
from hyper_parallel.passes.inplace_reuse import inplace_reuse_pass, overwrites_inputs, without_saved_overwrites

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
EAGER = PassContext()


def _reused(fn, *inputs, ctx=EAGER):
    """(pass output, {original target name: in-place target name} of the rewritten nodes), after
    checking the rewritten program returns exactly what ``fn`` does."""
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    expected = gm(*inputs)
    gm = inplace_reuse_pass(gm, ctx)
    torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)
    return gm, {n.name: n.target for n in gm.graph.nodes if meta.INPLACE_OF in n.meta}


def test_an_op_writes_into_a_fresh_tensor_it_reads_last_never_into_an_input():
    def fn(x):
        a = x * 3  # x is the caller's: stays out of place
        return a.exp().sum()  # a dies at exp

    gm, rewritten = _reused(fn, torch.randn(4, 8))
    assert rewritten == {"exp": aten.exp_.default}
    assert gm.graph.find_nodes(op="call_function", target=aten.mul.Tensor)


def test_a_tensor_read_later_or_returned_is_not_overwritten():
    def read_later(x):
        a = x * 3
        b = a.exp()  # a is read again below
        return a + b  # both die here: the add writes into a

    _, rewritten = _reused(read_later, torch.randn(4, 8))
    assert rewritten == {"add": aten.add_.Tensor}

    def returned(x):
        a = x * 3
        return a, a.exp()

    assert _reused(returned, torch.randn(4, 8))[1] == {}


def test_a_view_read_later_keeps_its_base():
    def fn(x):
        a = x * 3
        v = a.view(-1)
        b = a.exp()
        return b.sum(), v.sum()

    assert _reused(fn, torch.randn(4, 8))[1] == {}


def test_a_commutative_op_writes_into_its_second_operand_only_if_shapes_and_dtypes_match():
    def fn(x, y):
        a = x * 3  # [4, 1]: broadcast in the add, so not the one written
        c = y * 2  # [4, 8]: dies at the add
        return a + c

    gm, rewritten = _reused(fn, torch.randn(4, 1), torch.randn(4, 8))
    assert rewritten == {"add": aten.add_.Tensor}
    add = next(n for n in gm.graph.nodes if n.name == "add")
    assert add.args[0].name == "mul_1"  # c, swapped to the front

    def not_commutative(x, y):
        a = x * 3
        c = y * 2
        return a - c  # only c dies with the result's shape, and sub cannot swap

    assert _reused(not_commutative, torch.randn(4, 1), torch.randn(4, 8))[1] == {}

    def promoted(x):
        a = x.to(torch.bfloat16) * 2  # into the bf16 copy
        return a * torch.ones(4, 8)  # bf16 * fp32 -> fp32: not into a, into the fp32 ones

    gm, rewritten = _reused(promoted, torch.randn(4, 8))
    assert rewritten == {"mul": aten.mul_.Tensor, "mul_1": aten.mul_.Tensor}
    mul_1 = next(n for n in gm.graph.nodes if n.name == "mul_1")
    assert mul_1.args[0].target is aten.ones.default


def test_only_eager_codegen_and_not_a_reordered_backward():
    def fn(x):
        return (x * 3).exp().sum()

    assert _reused(fn, torch.randn(4, 8), ctx=PassContext(codegen="inductor"))[1] == {}
    gm = make_fx(fn, tracing_mode="fake")(torch.randn(4, 8))
    for n in gm.graph.nodes:
        if n.target is aten.exp.default:
            n.meta["partitioner_tag"] = "is_backward"
    gm = inplace_reuse_pass(gm, PassContext(backward_reordered=True))
    assert not any(meta.INPLACE_OF in n.meta for n in gm.graph.nodes)


def _meta(shape):
    return torch.empty(shape, device="meta")


def test_a_tensor_a_collective_read_lives_until_its_wait_is_read():
    """What a collective (or any op outside aten) is given may be read until its outputs die: a
    tensor all-reduced is not overwritten while the wait's result is still to be read."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(aten.mul.Tensor, (x, 3))
    reduced = g.call_function(c10d.all_reduce.default, (a, "sum", "0"))
    waited = g.call_function(c10d.wait_tensor.default, (reduced,))
    b = g.call_function(aten.exp.default, (a,))
    out = g.call_function(aten.add.Tensor, (waited, b))
    g.output(out)
    for n in (x, a, reduced, waited, b, out):
        n.meta["val"] = _meta([4, 8])
    inplace_reuse_pass(torch.fx.GraphModule(torch.nn.Module(), g), EAGER)
    assert b.target is aten.exp.default  # a's storage may still be gloo's
    assert out.target is aten.add_.Tensor and out.args[0] is b  # b is fresh and dies at the add


def test_the_copy_for_retain_graph_overwrites_no_input():
    g = torch.fx.Graph()
    saved = g.placeholder("saved")
    e = g.call_function(aten.exp_.default, (saved,))
    e.meta[meta.INPLACE_OF] = aten.exp.default
    m = g.call_function(aten.mul_.Tensor, (e, 2.0))
    m.meta[meta.INPLACE_OF] = aten.mul.Tensor
    fresh = g.call_function(aten.neg.default, (m,))
    g.output(fresh)
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    assert overwrites_inputs(gm)
    kept = without_saved_overwrites(gm)
    assert not overwrites_inputs(kept)
    x = torch.randn(3)
    before = x.clone()
    torch.testing.assert_close(kept(x), -(before.exp() * 2), rtol=0, atol=0)
    assert torch.equal(x, before)  # the input is as it was
    gm(x)
    assert not torch.equal(x, before)  # the program itself wrote into it
