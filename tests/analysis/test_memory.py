"""The memory estimator's liveness rules on small hand-built forward/backward programs, and the
allocation tracker that serves as its oracle. No process group: collectives only appear as graph
nodes with fake values."""

from types import SimpleNamespace

import pytest
import torch

from hyper_parallel import compat
from hyper_parallel.analysis.memory import OptimizerModel, estimate, optimizer_model
from hyper_parallel.testing.graph_builder import GraphBuilder
from hyper_parallel.testing.memory_tracker import AllocatorPeak, MemoryTracker, unique_storage_bytes

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
K = 16 * 16 * 4  # bytes of one [16, 16] fp32 tensor


def program(forward, backward, num_user_outputs=1):
    return SimpleNamespace(forward_gm=forward, backward_gm=backward, num_user_outputs=num_user_outputs)


def simple_backward(*saved_names):
    """Backward reading the saved tensors (first placeholders) and a scalar tangent; returns one
    [16, 16] gradient for the single parameter."""
    b = GraphBuilder((16, 16))
    saved = [b.input(n) for n in saved_names]
    tangent = b.input("tangents_1", *())
    with b.mode:
        tangent.meta["val"] = torch.empty(())
    grad = b(aten.mul.Tensor, saved[0], tangent)
    return b.module(grad)


def test_temporaries_are_freed_after_their_last_use():
    f = GraphBuilder((16, 16))
    x = f.input("primals_1")
    a = f(aten.mul.Tensor, x, 2)
    b = f(aten.add.Tensor, a, 1)  # a dies here: live x, a, b
    c = f(aten.mul.Tensor, b, 3)  # live x, b, c
    out = f(aten.sum.default, c)
    est = estimate(program(f.module(out, x), simple_backward("x")))
    assert est.params == K
    assert est.peak_forward == 3 * K
    assert est.peak_site.phase == "forward" and est.peak_site.node == b.name
    # Backward: the parameter, the kept loss, the tangent and the gradient.
    assert est.peak_backward == 2 * K + 4 + 4
    assert est.grads == K
    assert est.peak == 3 * K and sum(est.at_peak.values()) == est.peak


def test_views_share_their_base_storage():
    f = GraphBuilder((16, 16))
    x = f.input("primals_1")
    a = f(aten.mul.Tensor, x, 2)
    v = f(aten.view.default, a, [256])
    t = f(aten.t.default, a)
    s = f(aten.add.Tensor, v, 1)  # the transpose keeps a alive
    u = f(aten.add.Tensor, f(aten.view.default, s, [16, 16]), t)
    out = f(aten.sum.default, u)
    est = estimate(program(f.module(out, x), simple_backward("x")))
    assert est.peak_forward == 4 * K  # x, a (once for a, v and t), s, u


def test_unsafe_view_is_a_view_though_its_schema_says_otherwise():
    f = GraphBuilder((16, 16))
    x = f.input("primals_1")
    a = f(aten.mul.Tensor, x, 2)
    v = f(aten._unsafe_view.default, a, [256])
    p = f(aten.add.Tensor, a, f(aten.view.default, v, [16, 16]))
    out = f(aten.sum.default, p)
    assert estimate(program(f.module(out, x), simple_backward("x"))).peak_forward == 3 * K  # x, a, p


def test_reshape_copies_only_when_it_cannot_view():
    def peak(transpose_first):
        f = GraphBuilder((16, 16))
        x = f.input("primals_1")
        a = f(aten.mul.Tensor, x, 2)
        src = f(aten.t.default, a) if transpose_first else a
        r = f(aten.reshape.default, src, [256])
        out = f(aten.sum.default, f(aten.add.Tensor, f(aten.view.default, r, [16, 16]), a))
        return estimate(program(f.module(out, x), simple_backward("x"))).peak_forward

    # reshape of a transpose copies (a new K); of a contiguous tensor it is a view.
    assert peak(True) == peak(False) + K


def test_wait_tensor_returns_the_collective_buffer():
    f = GraphBuilder((16, 16))
    x = f.input("primals_1")
    gathered = f(c10d.all_gather_into_tensor.default, x, 2, "0")
    waited = f(c10d.wait_tensor.default, gathered)
    flat = f(aten.view.default, waited, [512])
    out = f(aten.sum.default, flat)
    est = estimate(program(f.module(out, x), simple_backward("x")))
    assert est.peak_forward == K + 2 * K + 4  # the waited value is the gathered buffer, not a copy
    assert est.comm_buffers_max == 2 * K


def _saved_program():
    """Forward saves a and b; backward uses a first, then b twice, with a larger temporary."""
    f = GraphBuilder((16, 16))
    x = f.input("primals_1")
    a = f(aten.mul.Tensor, x, 2)
    b = f(aten.mul.Tensor, a, 3)
    out = f(aten.sum.default, b)
    fwd = f.module(out, a, b)
    g = GraphBuilder((16, 16))
    sa, sb = g.input("a"), g.input("b")
    tangent = g.input("tangents_1")
    with g.mode:
        tangent.meta["val"] = torch.empty(())
    da = g(aten.mul.Tensor, sa, tangent)
    wide = g(aten.cat.default, [sb, sb])  # 2K, after a's last use
    grad = g(aten.add.Tensor, da, g(aten.slice.Tensor, wide, 0, 0, 16))
    return program(fwd, g.module(grad))


def test_saved_tensors_live_to_backward_end_or_their_last_use():
    held = estimate(_saved_program())
    boxed_program = _saved_program()
    compat.use_boxed_calling_convention(boxed_program.backward_gm)
    assert compat.is_boxed_call(boxed_program.backward_gm)
    boxed = estimate(boxed_program)
    assert held.saved_activations == boxed.saved_activations == 2 * K
    # Held until backward returns, a and b are live at the peak (the last add); freed at their
    # last uses (a's product, the cat), they are not.
    assert held.peak_backward - boxed.peak_backward == 2 * K
    assert held.peak_site.node == "add_tensor"


def test_kept_user_outputs_count_in_backward():
    f = GraphBuilder((16, 16))
    x = f.input("primals_1")
    logits = f(aten.mul.Tensor, x, 2)
    out = f(aten.sum.default, logits)
    prog = program(f.module(out, logits, x), simple_backward("x"), num_user_outputs=2)
    kept, dropped = estimate(prog, keep_outputs=True), estimate(prog, keep_outputs=False)
    assert kept.peak_backward - dropped.peak_backward == K + 4  # the logits and the loss


def test_optimizer_state_and_step_temporaries():
    f = GraphBuilder((16, 16))
    x, y = f.input("primals_1"), f.input("primals_2", 16)
    out = f(aten.sum.default, f(aten.mul.Tensor, x, y))
    g = GraphBuilder((16, 16))
    sx, sy = g.input("x"), g.input("y", 16)
    tangent = g.input("tangents_1")
    with g.mode:
        tangent.meta["val"] = torch.empty(())
    gx, gy = g(aten.mul.Tensor, sy, tangent), g(aten.mul.Tensor, sx, tangent)
    prog = program(f.module(out, x, y), g.module(g(aten.expand.default, gx, [16, 16]), gy))
    params = K + 16 * 4
    plain = estimate(prog, optimizer="sgd")
    assert plain.optimizer_state == 0 and plain.peak_optimizer == params + plain.grads
    adamw = estimate(prog, optimizer="adamw")
    assert adamw.optimizer_state == 2 * params
    # CPU: the per-parameter loop holds three temporaries the size of the largest parameter.
    assert adamw.peak_optimizer == params + adamw.grads + 2 * params + 3 * K
    foreach = estimate(prog, optimizer=OptimizerModel("adamw", state=2, foreach_temporaries=1, foreach=True))
    assert foreach.peak_optimizer == params + foreach.grads + 2 * params + params
    only_inputs = estimate(prog, ["param", "input"], optimizer="adamw")  # y is not a parameter
    assert only_inputs.optimizer_state == 2 * K and only_inputs.inputs == 16 * 4


def test_optimizer_models():
    assert optimizer_model(None).state == 0
    assert optimizer_model(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)).state == 1
    adam = optimizer_model(torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], weight_decay=0.1))
    assert (adam.state, adam.per_tensor_temporaries) == (2, 4)  # L2 decay adds a gradient copy
    assert optimizer_model(torch.optim.AdamW).name == "adamw"
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        optimizer_model("lion")
    with pytest.raises(ValueError, match="no model for Adagrad"):
        optimizer_model(torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(2))]))


def test_peak_site_names_the_module_and_source_line():
    f = GraphBuilder((16, 16))
    x = f.input("primals_1")
    big = f(aten.cat.default, [x, x, x])
    out = f(aten.sum.default, big, nn_module_stack={"m": ("model.layers.0.mlp", "LlamaMLP")},
            stack_trace='  File "model.py", line 7, in forward\n    return torch.cat([x, x, x]).sum()')
    site = estimate(program(f.module(out, x), simple_backward("x"))).peak_site
    assert (site.phase, site.node, site.module) == ("forward", out.name, "model.layers.0.mlp")
    assert "model.py" in site.source and "line 7" in site.source


def test_only_the_chosen_device_counts():
    f = GraphBuilder((16, 16))
    x = f.input("primals_1")
    out = f(aten.sum.default, f(aten.mul.Tensor, x, 2))
    est = estimate(program(f.module(out, x), simple_backward("x")), device="cuda")
    assert est.peak == 0 and est.device == "cuda"


def test_tracker_counts_each_storage_once_until_it_dies():
    base = torch.zeros(256)
    with MemoryTracker([base, base.view(16, 16)]) as tracker:
        assert tracker.baseline == 1024
        a = torch.empty(1024)  # 4 KiB
        view = a.view(32, 32)
        b = a * 2  # 4 KiB
        del a
        assert tracker.current == 1024 + 8192  # the view keeps a's storage
        del view
        assert tracker.current == 1024 + 4096
        c = torch.empty(256)
        del b, c
    assert tracker.peak == 1024 + 8192
    assert tracker.current == 1024
    assert unique_storage_bytes([base, base[:3]]) == 1024


def test_tracker_counts_storages_resized_in_place():
    """PyTorch FSDP2 frees its unsharded parameters by resizing their storage to 0 bytes and
    re-allocates them by resizing it back: no dispatch mode sees that, so the tracker wraps
    UntypedStorage.resize_ while it is active."""
    original = torch.UntypedStorage.resize_
    unsharded = torch.empty(1000)  # made before the region, then freed in place as FSDP2 does
    storage = unsharded.untyped_storage()
    storage.resize_(0)
    with MemoryTracker([unsharded]) as tracker:
        assert tracker.baseline == 0
        storage.resize_(4000)  # re-allocated: +4000 bytes
        a = torch.empty(250)  # +1000
        assert tracker.current == 5000
        storage.resize_(0)  # freed: -4000
        grown = torch.empty(10)
        grown.untyped_storage().resize_(400)  # a tracked storage grows from 40 to 400 bytes
        assert tracker.current == 1000 + 400
        del a, grown
    assert tracker.peak == 5000 and tracker.current == 0
    assert tracker.peak_op == "aten.empty.memory_format"
    assert torch.UntypedStorage.resize_ is original  # restored on exit


def test_allocator_peak_counts_what_the_allocator_holds():
    """The same measure as MemoryTracker from the allocator's own events: blocks allocated inside
    the region and alive at once, plus the baseline; a block made before it and freed inside does
    not count (nor lower the count)."""
    base = torch.zeros(256)
    before = torch.empty(4096)
    with AllocatorPeak([base]) as measured:
        a = torch.empty(1024)  # 4 KiB
        b = a * 2  # 4 KiB
        del a, before
        c = torch.empty(512)  # 2 KiB
        del b, c
    assert measured.baseline == 1024
    # a and b, plus the few bytes torch allocates itself (the wrapped scalar of ``a * 2``): the
    # allocator sees everything, not only op outputs.
    assert 1024 + 8192 <= measured.peak < 1024 + 8192 + 64


def test_allocator_peak_sees_inductor_buffers_the_tracker_cannot():
    """Inductor-generated code (codegen="inductor") allocates its buffers without the dispatcher:
    MemoryTracker sees nothing of a region's result, AllocatorPeak sees it (why the benches use it
    for --codegen inductor)."""
    from hyper_parallel.codegen import generate

    def f(x, w):
        return (torch.relu(x @ w).sin() * 2 + 1,)

    x, w = torch.randn(128, 128), torch.randn(128, 128)
    program = generate(compat.make_fx(f)(x, w), "test")
    program(x, w)  # compiles
    with MemoryTracker([x, w]) as tracker:
        out = program(x, w)
    with AllocatorPeak([x, w]) as measured:
        again = program(x, w)
    result = out[0].untyped_storage().nbytes()
    torch.testing.assert_close(out[0], again[0])
    assert tracker.peak < tracker.baseline + result  # the result itself is invisible to it
    assert measured.peak >= measured.baseline + result


def test_allocator_peak_measures_the_programs_without_profiler_ranges():
    """AllocatorPeak records with torch.profiler, which would switch the compiled programs to their
    copies with named ranges (runtime/profiled.py; under Inductor other regions, compiled on that
    first profiled call): it suspends them, so it measures the programs that train."""
    from torch.profiler import ProfilerActivity, profile

    from hyper_parallel.runtime.profiled import ranges_wanted

    seen = [ranges_wanted()]
    with AllocatorPeak():
        seen.append(ranges_wanted())
    with profile(activities=[ProfilerActivity.CPU]):
        seen.append(ranges_wanted())
    assert seen == [False, False, True]
