"""Step time and peak memory of context parallelism, against torch's context_parallel or data parallelism.

``python bench/bench_cp_step.py --cp 2`` spawns ``--cp`` gloo processes on CPU (one intra-op thread
each) and trains the example causal ``hyper_parallel.models.LlamaForCausalLM`` (seed 0) two ways,
interleaved step by step in the same run:

* hyper_parallel context parallelism: ``hp.parallelize(model, {"context_parallel":
  {"model.layers.*.self_attn": style}}, mesh)`` on a ``("cp",)`` mesh of ``--cp`` ranks; each rank
  passes its contiguous slice of every ``--seq-len``-token sequence (``hp.shard_sequence``); the
  loss is the global token mean and the gradients equal one device's. ``--mode``: ``ring``
  (``hp.ContextParallel(mode="ring")``, load-balanced causal chunks unless ``--no-load-balance``,
  the default), ``async`` (``hp.AsyncContextParallel()``: each K/V transfer overlapping the current
  block's attention), ``all_gather`` (``hp.ContextParallel(mode="all_gather")``: the ring's blocks,
  K/V all-gathered once per attention as torch's default), ``async_gather``
  (``hp.AsyncContextParallel(mode="all_gather")``: the gather overlapping the own block) or
  ``all_to_all`` (``hp.ContextParallel(mode="all_to_all")``, Ulysses; cp must divide the heads and
  key/value heads). ``--ulysses-degree u`` (1 < u < cp) runs the hybrid in any
  mode: all-to-all inside groups of u ranks, ring attention across the cp / u groups.

* baseline, the same model *without* context parallelism at the same tokens per rank: data
  parallelism over a ``("dp",)`` mesh of the same ranks where rank r trains, as ``--batch``
  independent sequences of ``seq_len / cp`` tokens, exactly the tokens it holds under CP.
  ``--baseline hp_dp`` (default): ``hp.parallelize(model, {}, dp_mesh)`` (the same compiler and
  runtime, so the ratio isolates what CP costs); ``--baseline ddp``: eager
  ``DistributedDataParallel``. **This is not a like-for-like peer, it is a lower bound**: its
  sequences are cp times shorter, so each rank computes cp times less causal attention (its
  queries see at most ``seq_len / cp`` keys instead of up to ``seq_len``) and moves no K/V blocks;
  the model learns a different (shorter-context) task. The ratio hp CP / baseline is therefore
  the price of the long context (the extra attention work plus CP's communication), not an
  overhead against another implementation of the same computation. The analytic attention share
  of each side's FLOPs is printed to size that difference.

* ``--baseline torch_cp``: the peer a user would otherwise pick, PyTorch's experimental
  ``context_parallel`` (``torch.distributed.tensor.experimental``; ring attention on DTensor,
  load-balanced, K/V blocks all-gathered: its defaults) on the same sequences, as torchtitan runs it:
  every rank holds the whole batch, which the context shards in place (input ids, position ids,
  labels shifted on the whole sequence: :class:`TorchCPLlama`), forward and backward inside the
  context, the parameters' gradients averaged by DDP. Its step-0 loss equals one device's. torch's
  context parallelism handles only the CUDA attention ops (``_scaled_dot_product_flash_attention``,
  ``_efficient_attention``, ``_cudnn_attention``); on CPU, SDPA runs
  ``_scaled_dot_product_flash_attention_for_cpu``, which it does not know (``--try-torch-cp``
  records the error). So with this baseline both sides run the CUDA flash-attention op through its
  CPU emulation (``hyper_parallel.testing.emulated_attention``: the CPU flash kernel's numbers, the
  CUDA op's arguments and outputs); hp's context parallelism handles that op as it would on a GPU.

Default model: hidden 256, intermediate 688, 2 layers, 4 heads of 64 with 2 key/value heads, vocab
1024 (1.98 M parameters), one sequence of 1024 tokens (512 per rank at cp=2, 256 at cp=4): causal
attention is ~23% of hp CP's FLOPs (38% at ``--seq-len 2048``) and a step stays under a second on
the 2-core host. Grouped-query attention (2 key/value heads), as the recorded results used: when
they were measured, hp's context-parallel compile of this model failed with as many key/value heads
as query heads (ring and all-to-all alike: ``ValueError: Cannot view a tensor with shape
torch.Size([1, 128, 4, 64]) and strides (32768, 64, 8192, 1) as a tensor with shape (1, 128,
256)!`` while lowering; the CP kernels returned dQ/dK/dV contiguous in ``[B, H, S, D]`` where the
one-device CPU kernel lays them out as ``[B, S, H, D]``, and the captured graph views the value
gradient's transpose). ``cp/attention.py`` now gives the gradients that layout, and ``--kv-heads 4``
runs.

A step is forward + backward + ``SGD.step`` + ``zero_grad``; ``--warmup`` steps each (the first
compiles), then ``--steps`` timed steps interleaved CP / baseline, each after a barrier; a step's
time is the slowest rank's; medians. Peak memory: one more step per side under
``hyper_parallel.testing.memory_tracker.MemoryTracker`` on every rank (live bytes of tensors:
parameters, gradients, activations, temporaries; for DDP its C++ reducer buckets are added), the
largest over ranks and rank 0's; hp's own estimate ``compile_summary()["memory"]["peak"]`` next
to it. Collectives per step: hp's ``compile_summary()`` (the ring's K/V transfers are
``send_recv``, per direction) and counted with the harness's ``CommCounter`` around one step.
Also the step-0 losses: CP against one device on the whole sequences (they must agree), and the
baseline's (a different task: shorter sequences).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import statistics
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hyper_parallel as hp  # noqa: E402
from _harness import (add_model_args, build_model, count_collectives, hp_collectives, launch,  # noqa: E402
                      print_collective_rows, print_time_rows, step, time_side_by_side)

ATTENTION = "model.layers.*.self_attn"
MODES = ("ring", "async", "all_gather", "async_gather", "all_to_all")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, default=2, help="context-parallel degree = processes (default 2)")
    p.add_argument("--mode", choices=MODES, default="ring",
                   help="ring: ContextParallel(mode='ring'); async: AsyncContextParallel(); all_gather: "
                        "ContextParallel(mode='all_gather'); async_gather: AsyncContextParallel(mode='all_gather'); "
                        "all_to_all: ContextParallel(mode='all_to_all') (Ulysses). Default ring")
    p.add_argument("--no-load-balance", action="store_true",
                   help="ring / async: load_balance=False (contiguous chunks; causal work unbalanced)")
    p.add_argument("--ulysses-degree", type=int, default=None,
                   help="the style's ulysses_degree: between 1 and --cp, all-to-all inside groups of that "
                        "many ranks and ring attention across the groups (any --mode)")
    add_model_args(p)
    p.set_defaults(hidden=256, intermediate=688, layers=2, heads=4, kv_heads=2, vocab=1024, seq_len=1024)
    p.add_argument("--batch", type=int, default=1, help="sequences of --seq-len tokens (default 1)")
    p.add_argument("--baseline", choices=("hp_dp", "ddp", "torch_cp"), default="hp_dp",
                   help="the other side: hp.parallelize(model, {}, dp mesh) (default) or eager DDP at the same "
                        "tokens per rank (lower bounds), or torch_cp: PyTorch's context_parallel on the same "
                        "sequences (both sides on the CUDA flash-attention op, emulated on CPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per side (median reported)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (default 1)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--try-torch-cp", action="store_true",
                   help="first try torch.distributed.tensor.experimental.context_parallel on this model "
                        "(one forward + backward) and record whether it runs")
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    return p.parse_args(argv)


def cp_style(args):
    u = args.ulysses_degree
    if args.mode == "all_to_all":
        return hp.ContextParallel(mode="all_to_all", load_balance=not args.no_load_balance, ulysses_degree=u)
    if args.mode in ("async", "async_gather"):
        mode = "all_gather" if args.mode == "async_gather" else "ring"
        return hp.AsyncContextParallel(mode=mode, load_balance=not args.no_load_balance, ulysses_degree=u)
    return hp.ContextParallel(mode=args.mode, load_balance=not args.no_load_balance, ulysses_degree=u)


def try_torch_context_parallel(ref, ids, world: int) -> dict:
    """One forward + backward of the model under torch's experimental ``context_parallel``
    (ring attention on DTensor) on a ``("cp",)`` mesh; whether it ran, or the error it raised."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    model = copy.deepcopy(ref)
    ids, labels = ids.clone(), ids.clone()  # sharded in place (and restored) by context_parallel
    try:
        with context_parallel(mesh, buffers=[ids, labels], buffer_seq_dims=[1, 1]):
            model(input_ids=ids, labels=labels)["loss"].backward()
        outcome = {"ran": True, "error": None}
    except Exception as exc:  # noqa: BLE001 - recorded, the bench goes on with the baseline
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "torch" in f.filename]
        where = f"{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}" if frames else ""
        outcome = {"ran": False, "error": f"{type(exc).__name__}: {exc}", "raised_at": where}
    ok = torch.tensor([1.0 if outcome["ran"] else 0.0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    outcome["ran_on_every_rank"] = bool(ok.item())
    return outcome


class TorchCPLlama(torch.nn.Module):
    """The example Llama as torchtitan runs a model under torch's ``context_parallel``: position ids
    and labels shifted on the whole sequence are buffers it shards with the input ids (the example
    model builds its positions with ``arange`` and shifts its labels itself, which on a shard would
    give every rank positions from 0 and drop the label of each shard's last token), and the loss
    is the global token mean (``num_items``: the sequences' counted labels) times the ranks, which
    DDP's gradient average over the cp ranks divides back."""

    def __init__(self, model, num_items: int, ranks: int):
        super().__init__()
        self.model, self.num_items, self.ranks = model, num_items, ranks

    def forward(self, input_ids, position_ids, labels):
        inner = self.model.model
        h = inner.embed_tokens(input_ids)
        freqs = position_ids[0].float()[:, None] * inner.rotary_emb.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        for layer in inner.layers:
            h = layer(h, cos, sin)
        logits = self.model.lm_head(inner.norm(h)).float()
        total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return {"loss": total * self.ranks / self.num_items}


class ShiftedLabelsLoss(torch.nn.Module):
    """hp's side against ``torch_cp``: the same computation as :class:`TorchCPLlama` (labels
    shifted on the whole sequence, the loss alone returned), on the unchanged model; hp makes the
    mean a global token mean and takes positions from the sequence itself."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        logits = self.model(input_ids=input_ids)["logits"].float()
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def torch_cp_side(ref, ids, world: int):
    """(model, its batch) of PyTorch's experimental ``context_parallel`` on a ``("cp",)`` mesh: ring
    attention with torch's defaults (load-balanced, K/V blocks all-gathered), the replicated
    parameters' gradients averaged by DDP, forward and backward inside the context each step
    (``step_context``, bench/_harness.py), which shards the batch's buffers in place and restores
    them after."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].contiguous()
    batch = {"input_ids": ids.clone(), "position_ids": torch.arange(ids.shape[1]).expand_as(ids).contiguous(),
             "labels": labels}
    model = DistributedDataParallel(TorchCPLlama(copy.deepcopy(ref), int((labels != -100).sum()), world),
                                    broadcast_buffers=False)
    buffers = [batch["input_ids"], batch["position_ids"], batch["labels"]]
    model.step_context = functools.partial(context_parallel, mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1])
    return model, batch


def analytic_flops(args, seq: int, tokens_per_rank: int) -> dict:
    """Analytic forward FLOPs per rank and step (backward ~2x both): the projections, MLP and head
    per token, and causal attention (QK^T and PV over the keys each query sees, on average
    (seq + 1) / 2 of its sequence's). Under CP a rank's queries see keys of the whole sequence;
    in the baseline only its own ``seq / cp``-token sequences."""
    h, i, d = args.hidden, args.intermediate, args.hidden // args.heads
    kv = args.kv_heads * d
    dense = 2 * (h * (h + 2 * kv + h) + 3 * h * i) * args.layers + 2 * h * args.vocab
    attention = 2 * 2 * args.heads * d * (seq + 1) / 2 * args.layers
    return {"dense": dense * tokens_per_rank, "attention": attention * tokens_per_rank,
            "attention_share": attention / (attention + dense)}


def _peak(model, opt, batch, extra: int = 0) -> list[int]:
    """Every rank's tracked peak of one more step (plus ``extra`` bytes the tracker cannot see)."""
    from hyper_parallel.testing.memory_tracker import MemoryTracker

    baseline = list(model.parameters()) + [t for s in opt.state.values() for t in s.values()
                                           if isinstance(t, torch.Tensor)]
    with MemoryTracker(baseline) as tracker:
        step(model, opt, batch)
    peaks = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(peaks, torch.tensor([float(tracker.peak + extra)], dtype=torch.float64))
    return [int(p.item()) for p in peaks]


def _estimate(model) -> int | None:
    summary = model.compile_summary() if hasattr(model, "compile_summary") else None
    return None if summary is None else summary["memory"]["peak"]


def run(args: argparse.Namespace) -> dict | None:
    with contextlib.ExitStack() as scope:
        if args.baseline == "torch_cp":
            # torch's context parallelism handles the CUDA attention ops only: both sides run the
            # CUDA flash-attention op, through its CPU emulation (the CPU flash kernel's numbers).
            from hyper_parallel.testing.emulated_attention import sdpa_as

            scope.enter_context(sdpa_as("flash"))
        return _run(args)


def _run(args: argparse.Namespace) -> dict | None:
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    if args.seq_len % (2 * world):
        raise ValueError(f"--seq-len {args.seq_len} must be a multiple of 2*cp = {2 * world}")
    ref = build_model(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    with torch.no_grad():
        ref_loss0 = ref(input_ids=ids, labels=ids)["loss"].item()  # one device, whole sequences

    torch_cp = try_torch_context_parallel(ref, ids, world) if args.try_torch_cp else None

    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    if args.baseline == "torch_cp":  # the loss both sides compute: labels shifted on the whole sequence
        shifted = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].contiguous()
        cp_batch = hp.shard_sequence({"input_ids": ids, "labels": shifted}, mesh)
        cp_model = hp.parallelize(ShiftedLabelsLoss(copy.deepcopy(ref)),
                                  {"context_parallel": {"model." + ATTENTION: cp_style(args)}}, mesh)
    else:
        cp_batch = hp.shard_sequence({"input_ids": ids, "labels": ids}, mesh)
        cp_model = hp.parallelize(copy.deepcopy(ref), {"context_parallel": {ATTENTION: cp_style(args)}}, mesh)
    cp_opt = torch.optim.SGD(cp_model.parameters(), lr=args.lr)

    # The baseline: the same tokens this rank holds under CP, as independent shorter sequences.
    local_len = args.seq_len // world
    base_ids = ids.view(args.batch, world, local_len)[:, rank].contiguous()
    base_batch = {"input_ids": base_ids, "labels": base_ids}
    if args.baseline == "hp_dp":
        dp_mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        base_model = hp.parallelize(copy.deepcopy(ref), {}, dp_mesh)
    elif args.baseline == "torch_cp":
        base_model, base_batch = torch_cp_side(ref, ids, world)
    else:
        base_model = DistributedDataParallel(copy.deepcopy(ref))
    base_opt = torch.optim.SGD(base_model.parameters(), lr=args.lr)

    measured = time_side_by_side((cp_model, cp_opt), (base_model, base_opt), cp_batch, args.warmup, args.steps,
                                 peer_batch=base_batch)
    counted = {**count_collectives({"hp_cp": (cp_model, cp_opt)}, cp_batch),
               **count_collectives({"baseline": (base_model, base_opt)}, base_batch)}
    reducer_buckets = 0
    if args.baseline in ("ddp", "torch_cp"):  # allocated by DDP's C++ reducer, alive all run, unseen by the tracker
        reducer_buckets = sum(p.numel() * p.element_size() for p in base_model.parameters() if p.requires_grad)
    peaks = {"hp_cp": _peak(cp_model, cp_opt, cp_batch), "baseline": _peak(base_model, base_opt, base_batch,
                                                                           reducer_buckets)}
    if rank != 0:
        return None
    cp_times, base_times = measured.hp_times, measured.peer_times
    cp_med, base_med = statistics.median(cp_times), statistics.median(base_times)
    summary = cp_model.compile_summary()
    ring_colls = {direction: {kind: by_axis for kind, by_axis in summary["collectives"][direction].items()}
                  for direction in ("forward", "backward")}
    base_summary = base_model.compile_summary() if args.baseline == "hp_dp" else None
    tokens = args.batch * local_len
    if args.baseline == "torch_cp":
        note = ("PyTorch's experimental context_parallel on the same sequences (ring attention on DTensor, "
                "load-balanced, K/V all-gathered: torch's defaults), gradients averaged by DDP, as torchtitan "
                "runs it; both sides run the CUDA flash-attention op through its CPU emulation")
    else:
        note = (f"data parallelism over the same {world} ranks, each training the {tokens} tokens it holds "
                f"under CP as {args.batch} sequence(s) of {local_len} tokens: {world}x shorter "
                "sequences, so less attention work per token and no K/V transfers; a lower bound, "
                "not a like-for-like peer")
    return {
        "bench": "cp_step",
        "world_size": world,
        "mesh": {"cp": world},
        "mode": args.mode,
        "style": repr(cp_style(args)),
        "baseline": args.baseline,
        "baseline_note": note,
        "config": {
            "hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
            "heads": args.heads, "kv_heads": args.kv_heads, "vocab": args.vocab,
            "seq_len": args.seq_len, "batch": args.batch, "tokens_per_rank": tokens,
            "baseline_seq_len": args.seq_len if args.baseline == "torch_cp" else local_len,
            "params": ref.num_parameters(),
        },
        "threads_per_rank": args.threads,
        "warmup": args.warmup,
        "steps": args.steps,
        "torch": torch.__version__,
        "torch_context_parallel": torch_cp if torch_cp is not None else "not tried (--try-torch-cp)",
        "analytic_fwd_flops_per_rank": {
            "hp_cp": analytic_flops(args, args.seq_len, tokens),
            "baseline": analytic_flops(args, args.seq_len if args.baseline == "torch_cp" else local_len, tokens),
        },
        "loss_step0": {"single_device_whole_sequences": ref_loss0, "hp_cp": measured.hp_loss0,
                       "baseline": measured.peer_loss0},
        "hp_cp_first_step_s (compile + step)": measured.hp_first_step_s,
        "step_time_s": {
            "hyper_parallel": {"median": cp_med, "min": min(cp_times), "max": max(cp_times), "all": cp_times},
            "baseline": {"median": base_med, "min": min(base_times), "max": max(base_times), "all": base_times},
        },
        "ratio_cp_over_baseline": cp_med / base_med,
        # Steps are interleaved, so step i of each side ran under about the same machine load: the
        # median of the per-pair ratios and the ratio of the fastest steps are less load-sensitive.
        "ratio_median_of_pairs": statistics.median(c / b for c, b in zip(cp_times, base_times)),
        "ratio_of_min": min(cp_times) / min(base_times),
        "peak_bytes": {
            "hp_cp": {"max_over_ranks": max(peaks["hp_cp"]), "per_rank": peaks["hp_cp"],
                      "hp_estimate_rank0": _estimate(cp_model)},
            "baseline": {"max_over_ranks": max(peaks["baseline"]), "per_rank": peaks["baseline"],
                         "hp_estimate_rank0": _estimate(base_model) if base_summary else None,
                         "ddp_reducer_buckets_included": reducer_buckets},
        },
        "collectives_per_step": {
            "hp_cp (compile_summary)": hp_collectives(summary),
            "hp_cp (counted)": counted["hp_cp"],
            "baseline (compile_summary)": hp_collectives(base_summary) if base_summary else None,
            "baseline (counted)": counted["baseline"],
        },
        "hp_cp_collectives_by_direction": ring_colls,
        "fallbacks": summary.get("fallbacks", []),
    }


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:.2f}"


def print_table(r: dict) -> None:
    c = r["config"]
    print(f"\nCP cp={r['world_size']} {r['style']} vs {r['baseline']} baseline; Llama {c['layers']}L h{c['hidden']} "
          f"{c['heads']} heads ({c['kv_heads']} kv) vocab {c['vocab']} ({c['params']:,} params); "
          f"{c['batch']} x seq {c['seq_len']} under CP ({c['tokens_per_rank']} tokens/rank), baseline "
          f"{c['batch']} x seq {c['baseline_seq_len']} per rank; {r['threads_per_rank']} thread/rank, median of "
          f"{r['steps']} steps (slowest rank)")
    print(f"BASELINE: {r['baseline_note']}")
    tcp = r["torch_context_parallel"]
    if isinstance(tcp, dict):
        print("torch context_parallel on CPU: " + ("ran" if tcp["ran_on_every_rank"] else
                                                   f"does not run: {tcp['error']} (at {tcp.get('raised_at', '')})"))
    fl = r["analytic_fwd_flops_per_rank"]
    print(f"analytic attention share of FLOPs: hp CP {fl['hp_cp']['attention_share']:.2f}, baseline "
          f"{fl['baseline']['attention_share']:.2f}; per-rank forward GFLOP hp CP "
          f"{(fl['hp_cp']['dense'] + fl['hp_cp']['attention']) / 1e9:.2f}, baseline "
          f"{(fl['baseline']['dense'] + fl['baseline']['attention']) / 1e9:.2f}")
    l0 = r["loss_step0"]
    print(f"loss at step 0: one device (whole sequences) {l0['single_device_whole_sequences']:.6f}, hp CP "
          f"{l0['hp_cp']:.6f}; baseline {l0['baseline']:.6f}"
          f"{'' if r['baseline'] == 'torch_cp' else ' (shorter sequences)'}; hp CP first "
          f"step (compile + step) {r['hp_cp_first_step_s (compile + step)']:.1f} s")
    print(f"{'':26}{'hp CP':>16}{'baseline':>16}{'CP/base':>10}")
    print_time_rows(r["step_time_s"], "baseline", r["ratio_cp_over_baseline"])
    print(f"{'  ratio: pairs / min':26}{'':32}{r['ratio_median_of_pairs']:>5.2f} /{r['ratio_of_min']:>4.2f}")
    pk = r["peak_bytes"]
    print(f"{'peak MB (max over ranks)':26}{_mb(pk['hp_cp']['max_over_ranks']):>16}"
          f"{_mb(pk['baseline']['max_over_ranks']):>16}"
          f"{pk['hp_cp']['max_over_ranks'] / pk['baseline']['max_over_ranks']:>10.2f}")
    for side, name in (("hp_cp", "hp CP"), ("baseline", "baseline")):
        print(f"  {name} peak MB per rank: {', '.join(_mb(p) for p in pk[side]['per_rank'])}")
    print(f"{'hp estimate MB (rank 0)':26}{_mb(pk['hp_cp']['hp_estimate_rank0']):>16}"
          f"{_mb(pk['baseline']['hp_estimate_rank0']):>16}")
    colls = r["collectives_per_step"]
    print_collective_rows(colls["hp_cp (compile_summary)"], colls["hp_cp (counted)"], colls["baseline (counted)"])
    print("(hp counted: every ring transfer and every all-to-all is one all_to_all_single call, so the counted "
          "all_to_all_single row is the summary's send_recv + all_to_all; the counted all_gather adds hp's per-call "
          "input-signature agreement)")
    for direction, kinds in r["hp_cp_collectives_by_direction"].items():
        parts = [f"{kind} {e['count']} ({e['bytes']:,} B)" for kind, by_axis in kinds.items()
                 for e in by_axis.values()]
        print(f"hp CP {direction}: " + ", ".join(parts))


def main(argv=None) -> None:
    args = parse_args(argv)
    launch(run, print_table, args, args.cp, threads=args.threads)


if __name__ == "__main__":
    main()
