"""The cse pass merges identical pure ops and functional collectives, never random ops."""

import torch

from hyper_parallel.passes.cse import cse_pass

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _graph_with_duplicates():
    g = torch.fx.Graph()
    x = g.placeholder("x")
    outs = []
    for _ in range(2):  # the same value gathered twice, by two consumers
        gathered = g.call_function(c10d.all_gather_into_tensor.default, (x, 2, "0"))
        waited = g.call_function(c10d.wait_tensor.default, (gathered,))
        outs.append(g.call_function(aten.relu.default, (waited,)))
    noise = [g.call_function(aten.rand_like.default, (x,)) for _ in range(2)]
    g.output(tuple(outs + noise))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def _count(gm, target):
    return len(gm.graph.find_nodes(op="call_function", target=target))


def test_cse_merges_duplicate_collectives_but_not_random_ops():
    gm = cse_pass(_graph_with_duplicates(), None)
    assert _count(gm, c10d.all_gather_into_tensor.default) == 1
    assert _count(gm, c10d.wait_tensor.default) == 1
    assert _count(gm, aten.relu.default) == 1
    assert _count(gm, aten.rand_like.default) == 2
    code = gm.code
    assert cse_pass(gm, None).code == code  # idempotent
