"""Pipeline stages reduce their data-parallel / FSDP gradients once per step (passes/pipeline_split.py).

PP x DP and PP x FSDP on 2 pp x 2 dp gloo ranks, 4 micro-batches, padded labels (ranks and
micro-batches count different numbers of tokens): 3 SGD steps against one device on the whole batch
(loss and every gradient), and the gradient-reduction bytes of a step, read from the compile summary
and measured while the step runs, equal those of the same plan without a pipeline (not 4x).
"""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.compat import TorchDispatchMode
from hyper_parallel.ir.collectives import collective_kind
from hyper_parallel.runtime.agreement_gate import await_agreement
from hyper_parallel.ir.kinds import InputKind
from hyper_parallel.pipeline.runtime import variants_of
from hyper_parallel.testing.parity import build_model, global_batch, gradient_sum_adds, gradients_waiting, local_batch
from hyper_parallel.testing.stepper import ParityStepper, batches

NUM_MICROBATCHES = 4
LAYERS = 2  # tiny: compile time is most of the file's time
FSDP = {"fully_shard": {"units": ["model.layers.*", ""]}}
_c10d = torch.ops._c10d_functional
_REDUCTIONS = (_c10d.all_reduce.default, _c10d.all_reduce_.default, _c10d.reduce_scatter_tensor.default)


class CountGradientReductions(TorchDispatchMode):
    """Bytes the all-reduces and reduce-scatters that run move (their inputs), except the loss's
    sum and token count (all-reduced once per micro-batch by design, as two scalars or packed in
    one [2] buffer; no gradient of these models has fewer than 64 elements)."""

    def __init__(self):
        super().__init__()
        self.bytes = self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _REDUCTIONS and args[0].numel() > 2:
            self.bytes += args[0].numel() * args[0].element_size()
            self.count += 1
        return func(*args, **(kwargs or {}))


def _summary_reduction_bytes(table: dict) -> int:
    return sum(v["bytes"] for kind in ("all_reduce", "reduce_scatter") for v in table.get(kind, {}).values())


def plain_reduction_bytes(plan: dict) -> dict:
    """The same plan without a pipeline, on the 2-rank dp mesh a pipeline stage has (the dp row of a
    2 x 2 mesh): per rank, the gradient reductions of one step (compile summary, and measured on
    the second step)."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))["dp"]
    model = hp.parallelize(build_model("llama", num_hidden_layers=LAYERS), plan, mesh)
    batch = local_batch(global_batch("llama", 8, 16, ignore_fraction=0.3), mesh)
    model(**batch)["loss"].backward()
    counter = CountGradientReductions()
    with counter:
        model(**batch)["loss"].backward()
    summary = model.compile_summary()["collectives"]
    return {"summary": _summary_reduction_bytes(summary["backward"]), "measured": counter.bytes}


def pipeline_parity(plan: dict, split_points, schedule: str, stages_per_rank: int = 1, mixed: bool = False,
                    steps: int = 3) -> dict:
    """``pmodel.step`` against one device, ``steps`` SGD steps; with ``mixed``, bf16 parameters and
    fp32 reduction against one device doing the same casts (fp32 master weights, a bf16 compute copy
    each step). Returns the summary and the measured gradient-reduction bytes of steps 2 and on."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    master = build_model("llama", num_hidden_layers=LAYERS)
    if mixed:
        policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        plan = {"fully_shard": hp.FullyShard(units=("model.layers.*", ""), mixed_precision=policy)}
    pipeline = hp.PipelinePlan(split_points=list(split_points), schedule=schedule, num_microbatches=NUM_MICROBATCHES,
                               stages_per_rank=stages_per_rank)
    pmodel = hp.parallelize(copy.deepcopy(master), {**plan, "pipeline": pipeline}, mesh)
    measured = []

    @contextlib.contextmanager
    def counted(record, i):
        if not record.step:  # the first step compiles (on fake tensors): measure the later ones
            yield
            return
        counter = CountGradientReductions()
        with counter:
            yield
        measured.append(counter.bytes)

    # mixed: against a bf16 copy of the fp32 master (which steps with its gradients); bf16 keeps 8
    # mantissa bits, the two runs round partial sums at different points.
    tolerance = {"loss_rtol": 1e-2, "loss_atol": 1e-2, "rtol": 5e-2, "atol": 2e-3, "grads": "close"} if mixed else {}
    stepper = ParityStepper(master, pmodel, mesh=mesh, batch=batches(batch=8, ignore_fraction=0.3),
                            forward=lambda m, b: m.step(b), backward_in_forward=True, micro_context=counted,
                            bf16_reference=mixed, **tolerance)
    stepper.run(steps)
    return {"rank": dist.get_rank(), "summary": pmodel.compile_summary(), "report": pmodel.pipeline_report(),
            "measured": measured, "losses": stepper.losses, "params": sorted(n for n, _ in pmodel.named_parameters()),
            "gates": _gate_positions(pmodel._hp.pipeline.last), "sums": _gradient_sums(pmodel._hp.pipeline.last)}


def _gradient_sums(entry) -> dict:
    """{stage program variant: (its parameters with a gradient, how its backward adds into the running
    sums: testing.parity.gradient_sum_adds)}, for this rank's stages."""
    sums = {}
    for s, program in entry.programs.items():
        for p in variants_of(program):
            params = sum(1 for info in p.primal_infos if info.kind == InputKind.PARAM)
            sums[f"stage{s}{p.name_suffix}"] = (params, gradient_sum_adds(p))
    return sums


def _gate_positions(entry) -> dict:
    """{stage forward program: (indices of its agreement waits, index of its first collective)}, for
    this rank's stages, every variant."""
    positions = {}
    for s, program in entry.programs.items():
        for variant, p in (("no sync", program), ("first", program.first), ("sync", program.sync)):
            if p is None:
                continue
            nodes = list(p.forward_gm.graph.nodes)
            first = next((i for i, n in enumerate(nodes) if collective_kind(n) is not None), None)
            positions[f"stage{s} {variant}"] = ([i for i, n in enumerate(nodes) if n.target is await_agreement], first)
    return positions


@pytest.fixture(scope="module")
def plain(dist4):
    """Per-rank gradient-reduction bytes of one step of the plans without a pipeline."""
    return {name: dist4.run(plain_reduction_bytes, plan)[0] for name, plan in (("dp", {}), ("fsdp", FSDP))}


TWO_STAGES = ["model.layers.1"]
FOUR_STAGES = ["model.layers.0", "model.layers.1", "model.norm"]  # embedding | layer | layer | norm + head
CASES = {
    "dp-1F1B": ({}, TWO_STAGES, "1F1B", 1, False, "dp"),
    "dp-interleaved": ({}, FOUR_STAGES, "Interleaved1F1B", 2, False, "dp"),
    "fsdp-GPipe": (FSDP, TWO_STAGES, "GPipe", 1, False, "fsdp"),
    "fsdp-interleaved": (FSDP, FOUR_STAGES, "Interleaved1F1B", 2, False, "fsdp"),
    "fsdp-bf16-1F1B": (FSDP, TWO_STAGES, "1F1B", 1, True, "fsdp"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_reduced_once_per_step_at_single_device_parity(dist4, plain, case):
    plan, split_points, schedule, stages_per_rank, mixed, family = CASES[case]
    # Parity (loss and every gradient, 3 steps) is asserted on every rank inside the job.
    results = dist4.run(pipeline_parity, plan, split_points, schedule, stages_per_rank, mixed)
    assert len({tuple(r["losses"]) for r in results}) == 1, "every rank returns the step's loss"
    # Per step, the pp ranks of one dp coordinate together reduce what one rank of the plan without
    # a pipeline reduces (not NUM_MICROBATCHES times as much): measured while the steps ran, and in
    # the compile summary.
    expected = plain[family]
    for dp in (0, 1):
        ranks = [r for r in results if r["rank"] % 2 == dp]
        for step in range(2):
            measured = sum(r["measured"][step] for r in ranks)
            assert measured == expected["measured"], (case, f"step {step + 1}", measured, expected)
        static = sum(_summary_reduction_bytes(r["summary"]["gradient_reductions_per_step"]) for r in ranks)
        assert static == expected["summary"], (case, static, expected)
    # Each pp rank holds only its stages' parameters (also under mixed precision, whose casts of the
    # parameter shards go to the stage that uses them).
    names = {n for n, _ in build_model("llama", num_hidden_layers=LAYERS).named_parameters()}
    assert not set(results[0]["params"]) & set(results[2]["params"])
    assert set(results[0]["params"]) | set(results[2]["params"]) == names
    for r in results:
        summary = r["summary"]
        assert summary["num_stages"] == len(split_points) + 1
        # Each local stage runs its sync variant once per step, its first variant once and the
        # no-sync one M-2 times; only the sync backward reduces over dp.
        for s in summary["local_stages"]:
            assert summary["runs_per_step"][f"stage{s} backward"] == 1, summary["runs_per_step"]
            assert summary["runs_per_step"][f"stage{s} backward (first micro-batch)"] == 1
            assert summary["runs_per_step"][f"stage{s} backward (no sync)"] == NUM_MICROBATCHES - 2
            for variant in (" (no sync)", " (first micro-batch)"):
                assert _summary_reduction_bytes(summary["collectives"][f"stage{s} backward{variant}"]) == 0
            assert _summary_reduction_bytes(summary["collectives"][f"stage{s} backward"]) > 0
        # Read from the compiled programs (bf16 parameters and fp32 reduction in the mixed case):
        # the first micro-batch's variant takes no sums; the others take one per parameter, add each
        # gradient into its sum before the next gradient is made, keep the sums in the reduce dtype,
        # and only the sync variant reduces them, each after its add.
        for name, (params, adds) in r["sums"].items():
            if name.endswith(" (first micro-batch)"):
                assert adds == [], (name, adds)
                continue
            assert len(adds) == params > 0 and gradients_waiting(adds) == 1, (case, name, adds)
            assert all(a["dtype"] == torch.float32 for a in adds), (case, name, adds)
            if name.endswith(" (no sync)"):
                assert all(a["reduced"] is None for a in adds), (case, name, adds)
            else:
                assert all(a["reduced"] is not None and a["reduced"] > a["added"] for a in adds), (case, name, adds)
        # pipeline_report() gives every pp rank's per-step numbers (those of its compile summary).
        pp_rank = r["rank"] // 2
        assert r["report"]["gradient_reductions_per_step"][pp_rank] == summary["gradient_reductions_per_step"]
        assert r["report"]["collectives_per_step"][pp_rank] == summary["collectives_per_step"]
        # A reused step's agreement is waited for right before each stage forward's first
        # collective (FSDP's all-gathers), and nowhere in a forward that has none.
        for name, (gates, first) in r["gates"].items():
            assert gates == ([] if first is None else [first - 1]), (case, name, gates, first)
    if family == "fsdp":
        assert all(first is not None for r in results for _, first in r["gates"].values()), results[0]["gates"]


def test_plain_reference_reduces_each_gradient_once(plain):
    """The reference the equality above compares with: the plans without a pipeline reduce every
    parameter's gradient once per step (the fp32 bytes of the whole model), as they run too."""
    model = build_model("llama", num_hidden_layers=LAYERS)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for name in ("dp", "fsdp"):
        assert plain[name]["summary"] == plain[name]["measured"] == param_bytes, plain


@pytest.mark.parametrize("schedule, stages_per_rank", [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2),
                                                     ("ZBH1", 1)])
@pytest.mark.parametrize("overlap_p2p", [False, True])
def test_every_schedule_syncs_each_stage_once_after_its_other_backwards(schedule, stages_per_rank, overlap_p2p):
    """For every built schedule, each stage of each rank runs the sync variant on exactly one
    micro-batch, whose backward is that stage's last (its last weight-gradient step when backwards
    are split, ZBH1: the reductions are in W): every other micro-batch's unreduced gradient is
    already pending when it reduces (pure schedule data, no process group). The ZBH1 parity cases
    are in test_pipeline_zero_bubble.py."""
    from hyper_parallel.pipeline.runtime import flat_steps, sync_microbatches
    from hyper_parallel.pipeline.schedules import SCHEDULES, SPLIT_BACKWARD_SCHEDULES, MetaStepType, build_schedule

    assert schedule in SCHEDULES and len(SCHEDULES) == 4, "a new schedule: add it here"
    gradient_step = MetaStepType.BACKWARD_WEIGHT if schedule in SPLIT_BACKWARD_SCHEDULES else MetaStepType.BACKWARD
    num_ranks = 2
    for rank, steps in build_schedule(schedule, num_ranks, 4, stages_per_rank, overlap_p2p).items():
        sync = sync_microbatches(steps)
        assert set(sync) == set(range(rank, num_ranks * stages_per_rank, num_ranks)), (rank, sync)
        backwards = [(s.stage, s.micro_batch) for s in flat_steps(steps) if s.step_type is gradient_step]
        for stage, mb in sync.items():
            mine = [m for st, m in backwards if st == stage]
            assert sorted(mine) == list(range(4)) and mine[-1] == mb, (rank, stage, mine, mb)
