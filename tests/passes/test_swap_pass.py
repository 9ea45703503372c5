"""The swap pass on the joint graph it gets in a real compile: a 2-layer MLP (plus a head outside
every region) with swap regions, captured and lowered on one simulated rank (torch's ``fake``
backend: no collective in the graph, so it runs on real tensors before and after the pass), through
the recompute pass (which marks the values to swap), then handed to ``swap_pass`` alone.

What the pass promises (its docstring): every marked forward value that backward reads gets a
copy to host right after its last forward use; backward reads a copy back instead, issued one group
ahead (when the previous group's first backward use runs) and waited for right before its own
group's first use; only the host copy crosses from forward to backward; with ``group_swap`` one
region's values travel as one flat buffer; numerics unchanged; idempotent."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from hyper_parallel.ir.phase import is_tagged_backward
from hyper_parallel.ir.graph import module_fqn_of
from hyper_parallel.passes.swap import swap_pass
from hyper_parallel.recompute import CheckpointPolicy
from hyper_parallel.runtime.host_copies import SWAP_IN, SWAP_OUT, SWAP_WAIT
from hyper_parallel.testing.pass_inputs import assert_valid_order, copy_graph_module, pass_input

aten = torch.ops.aten
SWAPS = (SWAP_OUT, SWAP_IN, SWAP_WAIT)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.proj(x)) * torch.sigmoid(x)


class Net(nn.Module):
    def __init__(self, return_hidden=False):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 8)
        self.return_hidden = return_hidden

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        loss = self.head(x).sum()
        return {"loss": loss, "hidden": x} if self.return_hidden else loss


def _swap_matmuls(ctx, op, *args, **kwargs):
    """Recompute policy: matmul outputs go to host memory, the rest is recomputed."""
    return CheckpointPolicy.MUST_SWAP if op is aten.addmm.default else CheckpointPolicy.PREFER_RECOMPUTE


PLANS = {
    "each": {"swap": {"layers.*": True}},
    "group": {"swap": {"layers.*": {"group_swap": True}}},
    "recompute-swap-matmuls": {"recompute": {"layers.*": _swap_matmuls}},
    "none": {},
}


@functools.lru_cache(maxsize=None)
def _marked(plan: str, return_hidden=False):
    return pass_input(functools.partial(Net, return_hidden), PLANS[plan], 1, "swap")


def _fresh(plan, **kwargs):
    gm, ctx = _marked(plan, **kwargs)
    return copy_graph_module(gm), ctx


def _execute(gm):
    """Run the joint graph on real tensors (the same for every call)."""
    gen = torch.Generator().manual_seed(1234)
    args = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta["val"]
        args.append(torch.randn(val.shape, dtype=val.dtype, generator=gen) if val.is_floating_point()
                    else torch.zeros(val.shape, dtype=val.dtype))
    return torch.fx.Interpreter(gm).run(*args, enable_io_processing=False)


def _run(gm, ctx):
    """The pass, checked: a valid graph, the same results on real tensors, idempotent. Returns the
    graph and ``{swapped value: its backward users before the pass}``."""
    swapped = {n: [u for u in n.users if is_tagged_backward(u)] for n in gm.graph.nodes
               if "hp_swap" in n.meta and not is_tagged_backward(n) and any(is_tagged_backward(u) for u in n.users)}
    order = [n.name for n in gm.graph.nodes]
    before = _execute(gm)
    gm = swap_pass(gm, ctx)
    assert_valid_order(gm)
    after = _execute(gm)
    assert len(before) == len(after)
    assert all((b is None and a is None) or torch.equal(b, a) for b, a in zip(before, after))
    code = gm.code
    assert swap_pass(gm, ctx).code == code  # idempotent
    assert [n.name for n in gm.graph.nodes if n.name in set(order)] == order  # the pass only inserts
    return gm, swapped


def _one(node, target):
    (user,) = [u for u in node.users if u.target is target]
    return user


def _only_between(nodes, order, lo, hi, allowed):
    return all(n.target in allowed for n in nodes[order[lo] + 1:order[hi]])


def test_each_value_goes_to_host_after_its_last_forward_use_and_comes_back_one_group_ahead():
    gm, ctx = _fresh("each")
    gm, swapped = _run(gm, ctx)
    # Every value the layers save for backward (relu, sigmoid and the layer's output each), but no
    # view of a parameter (t(weight) is free to keep).
    assert sorted((module_fqn_of(v), str(v.target)) for v in swapped) == sorted(
        (layer, str(op)) for layer in ("layers.0", "layers.1")
        for op in (aten.relu.default, aten.sigmoid.default, aten.mul.Tensor))
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    assert len(gm.graph.find_nodes(op="call_function", target=SWAP_OUT)) == len(swapped)
    restored = {}
    for value, users in swapped.items():
        out = _one(value, SWAP_OUT)
        back = _one(out, SWAP_IN)
        ready = _one(back, SWAP_WAIT)
        restored[value] = (back, ready)
        assert out.meta["hp_swap_copy"] == "to_host" and out.meta["partitioner_tag"] == "is_forward"
        assert back.meta["hp_swap_copy"] == "to_device" and back.meta["partitioner_tag"] == "is_backward"
        assert ready.meta["partitioner_tag"] == "is_backward"
        assert out.meta["val"].device == torch.device("cpu") and back.args[1] == value.meta["val"].device
        # Backward reads the copy back, never the value itself: only the host copy crosses.
        assert not [u for u in value.users if is_tagged_backward(u)]
        assert set(ready.users) == set(users)
        # To host right after the last forward use (other copies to host may sit in between).
        last = max([value, *(u for u in value.users if u is not out)], key=order.__getitem__)
        assert order[last] < order[out] and _only_between(nodes, order, last, out, {SWAP_OUT})
        # Waited for right before the first backward use (the next group's copy back may be
        # issued there too).
        first = min(users, key=order.__getitem__)
        assert order[ready] < order[first] and _only_between(nodes, order, ready, first, {SWAP_IN})
    # Copies back one group ahead: group k's is issued where group k-1's first use runs (before it,
    # after group k-1's wait); the first group's right before its own wait.
    groups = sorted(swapped, key=lambda v: min(order[u] for u in swapped[v]))
    first_back, first_ready = restored[groups[0]]
    assert _only_between(nodes, order, first_back, first_ready, set(SWAPS))
    for prev, cur in zip(groups, groups[1:]):
        anchor = min(swapped[prev], key=order.__getitem__)
        back, _ = restored[cur]
        assert order[restored[prev][1]] < order[back] < order[anchor]
        assert _only_between(nodes, order, back, anchor, set(SWAPS))


def test_group_swap_moves_each_region_as_one_buffer():
    gm, ctx = _fresh("group")
    gm, swapped = _run(gm, ctx)
    outs = gm.graph.find_nodes(op="call_function", target=SWAP_OUT)
    assert len(outs) == 2 and len(gm.graph.find_nodes(op="call_function", target=SWAP_IN)) == 2
    regions = {}
    for value in swapped:
        regions.setdefault(value.meta["hp_swap"], []).append(value)
    assert sorted(regions) == ["layers.0", "layers.1"] and all(len(v) == 3 for v in regions.values())
    for out in outs:
        flat = out.args[0]
        assert flat.target is aten.cat.default
        members = [r.args[0] for r in flat.args[0]]
        assert all(r.target is aten.reshape.default and r.args[1] == [-1] for r in flat.args[0])
        (region,) = {m.meta["hp_swap"] for m in members}
        assert sorted(members, key=lambda n: n.name) == sorted(regions[region], key=lambda n: n.name)
        numels = [m.meta["val"].numel() for m in members]
        assert tuple(out.meta["val"].shape) == (sum(numels),) and out.meta["val"].device == torch.device("cpu")
        ready = _one(_one(out, SWAP_IN), SWAP_WAIT)
        parts = _one(ready, aten.split_with_sizes.default)
        assert parts.args[1] == numels
        for i, member in enumerate(members):
            (piece,) = [u for u in parts.users if u.args[1] == i]
            (shaped,) = piece.users
            assert shaped.target is aten.reshape.default and shaped.args[1] == list(member.meta["val"].shape)
            assert set(shaped.users) == set(swapped[member])
            assert not [u for u in member.users if is_tagged_backward(u)]


def test_must_swap_values_of_a_recompute_region_feed_the_recompute_from_host():
    """recompute with a policy that swaps matmul outputs: backward's recomputed relu reads the
    addmm's copy back, and the addmm is not recomputed."""
    gm, ctx = _fresh("recompute-swap-matmuls")
    gm, swapped = _run(gm, ctx)
    assert sorted(module_fqn_of(v) for v in swapped) == ["layers.0.proj", "layers.1.proj"]
    assert all(v.target is aten.addmm.default for v in swapped)
    for value, users in swapped.items():
        ready = _one(_one(_one(value, SWAP_OUT), SWAP_IN), SWAP_WAIT)
        recomputed = [u for u in ready.users if u.meta.get("hp_recompute")]
        assert [u.target for u in recomputed] == [aten.relu.default]
    assert not [n for n in gm.graph.nodes if n.meta.get("hp_recompute") and n.target is aten.addmm.default]


def test_nothing_marked_no_change():
    gm, ctx = _fresh("none")
    code = gm.code
    gm, swapped = _run(gm, ctx)
    assert not swapped and gm.code == code


def test_a_swapped_value_the_model_also_returns():
    """A value the model returns is held by the caller anyway: it is not swapped (before the fix
    its copy to host went after the output node and the graph was invalid); the others are."""
    gm, ctx = _fresh("each", return_hidden=True)
    gm, swapped = _run(gm, ctx)  # a valid graph with the same numbers
    (output,) = gm.graph.find_nodes(op="output")
    assert list(gm.graph.nodes)[-1] is output
    returned = [v for v in swapped if output in v.users]
    assert len(returned) == 1 and not [u for u in returned[0].users if u.target is SWAP_OUT]
    assert all(_one(v, SWAP_OUT) for v in swapped if v not in returned)
