"""The cost model (hyper_parallel.cost): alpha-beta formulas, node placement, FLOP counts, the
two-stream simulation's overlap, the Chrome trace, and profile lookup.

Hand-built fx graphs carry fake values (collectives only appear as nodes, nothing communicates);
the FLOP count of a compiled program uses a 1-rank gloo world, and the mesh test torch's ``fake``
backend, each set up and torn down by its own test so they never coexist.
"""

import dataclasses
import json
import operator
import socket

import pytest
import torch
import torch.distributed as dist

from hyper_parallel import compat
from hyper_parallel.cost import (
    PROFILES,
    AxisInfo,
    HardwareProfile,
    axis_infos,
    axis_table,
    collective_time,
    get_profile,
    mfu,
    node_work,
    roofline_time,
    simulate,
    to_chrome_trace,
)
from hyper_parallel.cost.comm import ring_volume
from hyper_parallel.testing.graph_builder import GraphBuilder

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def profile(**changes) -> HardwareProfile:
    """Round numbers so every expected time is exact arithmetic."""
    base = dict(
        name="test", peak_flops={"fp32": 1e9}, hbm_bandwidth=1e30, memory_bytes=1 << 30, devices_per_node=8,
        intra_node_bandwidth=1e9, intra_node_latency=1e-5, inter_node_bandwidth=1e8, inter_node_latency=1e-4,
        matmul_efficiency=1.0, memory_efficiency=1.0, link_efficiency=1.0, op_overhead_s=0.0,
    )
    return HardwareProfile(**{**base, **changes})


# -- alpha-beta ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, input_bytes, steps, moved", [
    ("all_gather", 1000, 3, 3000),  # shard of 1000 B -> full 4000 B, (n-1)/n of it
    ("reduce_scatter", 4000, 3, 3000),
    ("all_reduce", 4000, 6, 6000),  # 2(n-1)/n of the buffer in 2(n-1) steps
    ("all_to_all", 4000, 3, 3000),
    ("broadcast", 4000, 3, 4000),
])
def test_ring_collective_times(kind, input_bytes, steps, moved):
    assert ring_volume(kind, input_bytes, 4) == (steps, pytest.approx(moved))
    axis = AxisInfo("tp", 4)  # intra-node: 1e9 B/s, 10 us per step
    assert collective_time(kind, input_bytes, axis, profile()) == pytest.approx(steps * 1e-5 + moved / 1e9)
    # Link efficiency scales only the bandwidth term.
    half = collective_time(kind, input_bytes, axis, profile(link_efficiency=0.5))
    assert half == pytest.approx(steps * 1e-5 + 2 * moved / 1e9)


def test_single_rank_group_costs_nothing_and_bad_kind_raises():
    assert collective_time("all_reduce", 1 << 20, AxisInfo("dp", 1), profile()) == 0.0
    with pytest.raises(ValueError, match="unknown collective kind 'all_scatter'"):
        ring_volume("all_scatter", 8, 2)


def test_intra_vs_inter_node_selection():
    table = axis_table((16, 2, 8), ("dp", "cp", "tp"))  # 256 ranks, 8 per node
    assert (table["tp"].stride, table["cp"].stride, table["dp"].stride) == (1, 8, 16)
    assert table["tp"].is_intra_node(8)  # ranks 0..7
    assert not table["cp"].is_intra_node(8)  # ranks 0 and 8
    assert not table["dp"].is_intra_node(8)
    assert AxisInfo("x", 2, 4).is_intra_node(8)  # ranks 0 and 4
    assert not AxisInfo("x", 2, 4, first=4).is_intra_node(8)  # ranks 4 and 8: two nodes
    assert not AxisInfo("unknown", 2, None).is_intra_node(8)  # placement unknown: inter-node
    p = profile()
    # Same bytes: the inter-node group pays its 10x slower link and 10x latency.
    assert collective_time("all_gather", 1000, table["tp"], p) == pytest.approx(7 * 1e-5 + 7000 / 1e9)
    assert collective_time("all_gather", 1000, table["cp"], p) == pytest.approx(1e-4 + 1000 / 1e8)


def test_axis_infos_of_a_real_mesh_and_its_flattened_axes():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=32)
    try:
        mesh = init_device_mesh("cpu", (2, 2, 8), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        compat.flatten_mesh(mesh, ("dp_replicate", "dp_shard"), "dp")
        infos = axis_infos(mesh)
        by_name = {info.name: info for info in infos.values()}
        assert set(by_name) == {"dp_replicate", "dp_shard", "tp", "dp"}
        assert infos[mesh.get_group("tp").group_name] == AxisInfo("tp", 8, 1, 7, first=0)
        assert by_name["dp_shard"] == AxisInfo("dp_shard", 2, 8, 8, first=3)
        assert by_name["dp"] == AxisInfo("dp", 4, 8, 24, first=3)
        assert by_name["tp"].is_intra_node(8) and not by_name["dp_shard"].is_intra_node(8)
    finally:
        dist.destroy_process_group()


# -- FLOPs -----------------------------------------------------------------------------------------


@pytest.fixture
def gloo_world(monkeypatch):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_flops_of_a_compiled_linear_program(gloo_world):
    import hyper_parallel as hp

    m, k, n = 6, 16, 24
    mesh = hp.init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    pmodel = hp.parallelize(torch.nn.Linear(k, n, bias=False), {}, mesh)
    pmodel(torch.randn(m, k)).sum().backward()
    forward, backward = pmodel.compiled_programs()
    flops = lambda gm: sum(node_work(node).flops for node in gm.graph.nodes)  # noqa: E731
    assert flops(forward) == 2 * m * n * k
    # The weight's gradient only (the input needs none): one more M x N x K matmul.
    assert flops(backward) == 2 * m * n * k
    est = simulate((forward, backward), {}, "cpu")
    assert est.flops == 4 * m * n * k



def _cpu_flash_graph(b: int, h: int, s: int, d: int):
    """A graph of the CPU flash-attention forward and backward: (builder, forward, its output, backward)."""
    g = GraphBuilder()
    q, k, v = g.input("q", b, h, s, d), g.input("k", b, h, s, d), g.input("v", b, h, s, d)
    attn = g(aten._scaled_dot_product_flash_attention_for_cpu.default, q, k, v)
    out, lse = g(operator.getitem, attn, 0), g(operator.getitem, attn, 1)
    grad = g(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, out, q, k, v, out, lse, 0.0, False)
    return g, attn, out, grad


def test_cpu_flash_attention_flops():
    b, h, s, d = 2, 4, 32, 8
    g, attn, out, grad = _cpu_flash_graph(b, h, s, d)
    assert node_work(attn).flops == 2 * (2 * b * h * s * s * d)  # Q K^T and P V
    assert node_work(grad).flops == 5 * (2 * b * h * s * s * d)  # recompute, dP, dV, dQ, dK
    assert node_work(out).kind == "view" and node_work(out).bytes == 0


def test_attention_kernels_are_priced_at_the_attention_efficiency():
    """The fused attention kernels (forward and backward) run at the profile's
    attention_efficiency, every other kernel at matmul_efficiency; unset, attention is a matmul."""
    g, attn, out, grad = _cpu_flash_graph(1, 2, 512, 16)
    w = g.input("w", 512, 512)
    mm = g(aten.mm.default, w, w)
    assert node_work(attn).attention and node_work(grad).attention and not node_work(mm).attention
    plain = dataclasses.replace(get_profile("cpu"), attention_efficiency=None, op_overhead_s=0.0)
    slow = dataclasses.replace(plain, attention_efficiency=0.25)
    for node in (attn, grad):  # compute-bound at this size: the time scales with 1 / efficiency
        assert roofline_time(node_work(node), slow) == pytest.approx(4 * roofline_time(node_work(node), plain))
    assert roofline_time(node_work(mm), slow) == roofline_time(node_work(mm), plain)
    with pytest.raises(ValueError, match="attention_efficiency=1.5"):
        dataclasses.replace(plain, attention_efficiency=1.5)


def test_bytes_and_views():
    g = GraphBuilder()
    x = g.input("x", 16, 16)
    y = g(aten.mul.Tensor, x, x)
    view = g(aten.view.default, y, [256])
    t = g(aten.t.default, y)
    assert node_work(y).bytes == 3 * 16 * 16 * 4 and node_work(y).flops == 0
    assert node_work(view).kind == node_work(t).kind == "view"
    assert node_work(view).bytes == 0


# -- simulation ------------------------------------------------------------------------------------

M = 64  # a [M, M] @ [M, M] matmul: 2 M^3 FLOPs = 524,288 -> 524.288 us at 1 GFLOP/s


def _program(wait_late: bool, num_matmuls: int = 3):
    """all_reduce of 1 MiB over a 2-rank group, then matmuls; the wait right after the collective
    or after the matmuls."""
    g = GraphBuilder()
    x, w = g.input("x", 512, 512), g.input("w", M, M)
    reduced = g(c10d.all_reduce.default, x, "sum", "grp")
    waited = None if wait_late else g(c10d.wait_tensor.default, reduced)
    h = w
    for _ in range(num_matmuls):
        h = g(aten.mm.default, h, w)
    if wait_late:
        waited = g(c10d.wait_tensor.default, reduced)
    return g.module(h, waited)


MATMUL_S = 2 * M**3 / 1e9
COMM_S = 2 * 1e-5 + 512 * 512 * 4 / 1e9  # n=2 all-reduce: 2 steps, 2(n-1)/n = 1 x the buffer


def test_wait_placement_decides_the_overlap():
    axes = {"grp": AxisInfo("dp", 2)}
    early = simulate(_program(wait_late=False), axes, profile())
    late = simulate(_program(wait_late=True), axes, profile())
    assert MATMUL_S < COMM_S < 3 * MATMUL_S
    for est in (early, late):
        assert est.compute_s == pytest.approx(3 * MATMUL_S)
        assert est.comm_s == pytest.approx(COMM_S)
        assert est.flops == 3 * 2 * M**3
    # Waited at once: compute stalls for the whole collective.
    assert early.exposed_comm_s == pytest.approx(COMM_S)
    assert early.step_s == pytest.approx(3 * MATMUL_S + COMM_S)
    # Waited after the matmuls, which take longer: fully hidden.
    assert late.exposed_comm_s == 0.0
    assert late.step_s == pytest.approx(3 * MATMUL_S)
    # One matmul does not cover it: the rest is exposed.
    short = simulate(_program(wait_late=True, num_matmuls=1), axes, profile())
    assert short.exposed_comm_s == pytest.approx(COMM_S - MATMUL_S)
    assert short.step_s == pytest.approx(COMM_S)
    waits = short.timeline.of("wait")
    assert len(waits) == 1 and waits[0].start_s == pytest.approx(MATMUL_S)


def test_issue_overhead_and_comm_stream_order():
    axes = {"grp": AxisInfo("dp", 2)}
    est = simulate(_program(wait_late=True), axes, profile(op_overhead_s=1e-6))
    comm = est.timeline.of("comm")
    assert len(comm) == 1 and comm[0].start_s == pytest.approx(1e-6)  # after its issue on the compute stream
    assert comm[0].name == "all_reduce[dp]" and comm[0].stream == "comm"
    with pytest.raises(ValueError, match="process group 'grp', which is not in the axis table"):
        simulate(_program(wait_late=True), {}, profile())


def test_optimizer_step_and_mfu():
    axes = {"grp": AxisInfo("dp", 2)}
    # 1 GB/s memory: the matmuls stay compute-bound (49 KB each = 49 us < 524 us of FLOPs).
    p = profile(hbm_bandwidth=1e9, optimizer_tensor_overhead_s=1e-5)
    est = simulate(_program(wait_late=True), axes, p, optimizer_bytes=10**6, optimizer_tensors=3)
    assert est.optimizer_s == pytest.approx(1e-3 + 3e-5)
    assert est.step_s == pytest.approx(3 * MATMUL_S + 1e-3 + 3e-5)
    assert est.timeline.events[-1].phase == "optimizer"
    assert mfu(est.flops, est.step_s, p, "fp32") == pytest.approx(est.flops / est.step_s / 1e9)
    with pytest.raises(ValueError, match="step time must be positive"):
        mfu(1, 0.0, "h100")


def test_chrome_trace_is_valid_json():
    est = simulate(_program(wait_late=False), {"grp": AxisInfo("dp", 2)}, profile())
    trace = to_chrome_trace(est.timeline)
    assert json.loads(json.dumps(trace)) == trace
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(est.timeline) == 5  # all_reduce, wait, 3 matmuls
    for e in complete:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e)
    by_cat = {e["cat"]: e for e in complete}
    assert by_cat["comm"]["tid"] != by_cat["compute"]["tid"] == by_cat["wait"]["tid"]
    assert by_cat["comm"]["dur"] == pytest.approx(COMM_S * 1e6)  # microseconds
    assert by_cat["compute"]["args"]["flops"] == 2 * M**3
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"compute", "comm"}


def _gated_program(matmuls_before: int, collective: bool = True):
    """``matmuls_before`` matmuls, then (``collective``) an all-reduce and its wait, with the
    agreement gate the compile driver inserts (before the first collective; none without one)."""
    from hyper_parallel.runtime.agreement_gate import insert_gate

    g = GraphBuilder()
    x, w = g.input("x", 512, 512), g.input("w", M, M)
    h = w
    for _ in range(matmuls_before):
        h = g(aten.mm.default, h, w)
    outputs = [h]
    if collective:
        outputs.append(g(c10d.wait_tensor.default, g(c10d.all_reduce.default, x, "sum", "grp")))
    gm = g.module(*outputs)
    assert insert_gate(gm) is collective
    return gm


def test_the_agreement_is_waited_for_at_the_gate_or_at_the_forwards_end():
    """The per-call agreement (log2(world) host rounds) runs while the forward computes up to its
    gate: exposed only where the compute before the gate is shorter; a forward without a
    collective waits for it as it returns."""
    axes = {"grp": AxisInfo("dp", 2)}
    p = profile(host_message_latency_s=1e-4)
    plain = simulate(_gated_program(1), axes, p)
    assert plain.agreement_s == plain.agreement_exposed_s == 0.0  # one rank's view: nothing to agree
    small = simulate(_gated_program(1), axes, p, agreement_ranks=8)  # 3 rounds, 0.3 ms < one matmul
    assert small.agreement_s == pytest.approx(3e-4) and small.agreement_exposed_s == 0.0
    assert small.step_s == pytest.approx(plain.step_s)
    host = [e for e in small.timeline if e.stream == "host"]
    assert len(host) == 1 and host[0].category == "agreement" and host[0].start_s == 0.0
    big = simulate(_gated_program(1), axes, p, agreement_ranks=1024)  # 10 rounds, 1 ms > one matmul
    assert big.agreement_exposed_s == pytest.approx(1e-3 - MATMUL_S)
    assert big.step_s == pytest.approx(plain.step_s + 1e-3 - MATMUL_S)
    waits = [e for e in big.timeline.of("wait") if e.name == "wait (agreement)"]
    assert len(waits) == 1 and waits[0].start_s == pytest.approx(MATMUL_S)
    assert big.exposed_comm_s == pytest.approx(plain.exposed_comm_s)  # the device streams' exposure is apart
    late = simulate(_gated_program(2), axes, p, agreement_ranks=1024)  # gate after 2 matmuls: hidden
    assert late.agreement_exposed_s == 0.0
    alone = simulate(_gated_program(1, collective=False), axes, p, agreement_ranks=1024)  # no gate: at the end
    assert alone.agreement_exposed_s == pytest.approx(1e-3 - MATMUL_S)
    assert alone.step_s == pytest.approx(1e-3)


# -- profiles --------------------------------------------------------------------------------------


def test_profile_lookup():
    assert set(PROFILES) == {"h100", "h200", "a100", "ascend-910b", "cpu"}
    assert get_profile("H100").peak_flops["bf16"] == 989e12
    h200 = get_profile("h200")
    assert h200.hbm_bandwidth == 4.8e12 and h200.peak_flops == get_profile("h100").peak_flops
    assert get_profile("a100").intra_node_bandwidth == 300e9
    with pytest.raises(ValueError, match=r"unknown hardware profile 'tpu-v5'; choose one of \['a100', 'ascend-910b', "
                                         r"'cpu', 'h100', 'h200'\]"):
        get_profile("tpu-v5")
    with pytest.raises(ValueError, match="link_efficiency=1.5 must be in"):
        profile(link_efficiency=1.5)


def test_ranks_beyond_the_host_cores_time_share_them():
    """On the cpu profile (2 cores) 4 busy ranks run at half speed, a pipeline idle a third of
    its step at two thirds; accelerators never share."""
    from hyper_parallel.cost.hardware import CPU, H100

    assert CPU.host_sharing(2) == 1.0 and CPU.host_sharing(4) == 2.0
    assert CPU.host_sharing(4, busy_fraction=2 / 3) == pytest.approx(4 / 3)
    assert CPU.host_sharing(4, busy_fraction=0.25) == 1.0
    assert H100.host_sharing(8) == 1.0


def test_a_profile_file_round_trips_and_names_what_is_wrong(tmp_path):
    """``hyper-parallel calibrate --out`` writes save_profile's JSON; get_profile reads a .json path."""
    from hyper_parallel.cost import hardware

    path = str(tmp_path / "mine.json")
    mine = dataclasses.replace(hardware.CPU, name="mine", host_cores=16, devices_per_node=8)
    assert hardware.save_profile(mine, path) == path
    assert hardware.load_profile(path) == mine and get_profile(path) == mine
    data = json.loads(open(path).read())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**data, "tflops": 3}))
    with pytest.raises(ValueError, match=r"unknown fields \['tflops'\]"):
        get_profile(str(bad))
    bad.write_text(json.dumps({k: v for k, v in data.items() if k != "peak_flops"}))
    with pytest.raises(ValueError, match="peak_flops"):
        get_profile(str(bad))
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match="not a hardware profile written by"):
        get_profile(str(bad))
    with pytest.raises(ValueError, match="does not exist"):
        get_profile(str(tmp_path / "missing.json"))
