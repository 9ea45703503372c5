"""fuse_small_reductions on the graph it receives in a real compile (fake backend, 4 ranks on dp):
independent small all-reduces of one phase become one, dependent ones stay apart, the order stays
valid, and a second run changes nothing."""

import torch
import torch.nn as nn

from hyper_parallel.ir import meta
from hyper_parallel.passes.fuse_small_reductions import fuse_small_reductions
from hyper_parallel.testing.pass_inputs import assert_valid_order, copy_graph_module, pass_input

c10d = torch.ops._c10d_functional


class BatchStatistics(nn.Module):
    """Two batch statistics the loss needs whole (each a Partial sum over the batch-sharded rows);
    with ``chained`` the second reads the first, so they cannot share a reduction."""

    def __init__(self, chained: bool = False):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.chained = chained

    def forward(self, x):
        h = self.lin(x)
        a = h.sum(0).sigmoid()
        b = ((h * a) if self.chained else (h * h)).sum(0).tanh()
        return (a * b).sum()


def _reductions(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and n.target in (c10d.all_reduce.default, c10d.all_reduce_.default)]


def test_independent_statistics_share_one_all_reduce():
    gm, _ = pass_input(BatchStatistics, {}, 4, "fuse_small_reductions")
    assert len(_reductions(gm)) >= 2
    out = fuse_small_reductions(copy_graph_module(gm))
    assert_valid_order(out)
    fused = [n for n in _reductions(out) if str(n.meta.get(meta.BUCKET, "")).startswith("small reductions forward")]
    assert len(fused) == 1 and "(2 values)" in fused[0].meta[meta.BUCKET], [n.meta.get(meta.BUCKET) for n in _reductions(out)]
    assert len(_reductions(out)) < len(_reductions(gm))
    order = [n.name for n in out.graph.nodes]
    assert [n.name for n in fuse_small_reductions(out).graph.nodes] == order  # idempotent


def test_a_statistic_that_reads_another_keeps_its_own_reduction():
    gm, _ = pass_input(lambda: BatchStatistics(chained=True), {}, 4, "fuse_small_reductions")
    out = fuse_small_reductions(copy_graph_module(gm))
    assert_valid_order(out)
    assert not any(str(n.meta.get(meta.BUCKET, "")).startswith("small reductions forward") for n in out.graph.nodes)
