"""Step time of expert parallelism: hyper_parallel vs an eager expert-parallel reference, side by side.

``python bench/bench_ep_step.py`` spawns ``--world`` (default 4) gloo processes on CPU, one intra-op
thread each, all on one ``("ep",)`` mesh axis. Both sides train the same example MoE decoder
(``hyper_parallel.models.moe``, seed 0) and every rank feeds the same local batch to both:

* hyper_parallel: ``hp.parallelize(model, {"expert_parallel": {"model.layers.*.mlp.experts":
  hp.ExpertParallel()}}, mesh)``: each rank keeps ``num_experts / world`` experts; the compiled
  program dispatches and combines with all-to-alls; dense gradients are all-reduced in buckets.
* eager reference, written here the way torchtitan's expert parallelism works: each experts module
  keeps its rank's slice of the stacked weights and its forward sorts the rows by expert,
  exchanges the rows per expert with ``all_to_all_single``, dispatches the rows with the
  differentiable ``torch.distributed.nn.functional.all_to_all_single`` (variable splits), runs the
  module's own forward on them, and combines with the transposed all-to-all; the dense parameters
  are wrapped in ``DistributedDataParallel`` (the expert weights excluded). Its loss is each rank's
  local mean (DDP averages the dense gradients), and a hook divides the expert gradients by the
  world size, so both sides take the same optimizer steps on equal per-rank token counts. Its
  load-balancing loss uses the whole batch's statistics as hp's (and one device's) does: the
  routed fractions and mean probabilities are summed over the ranks with the differentiable
  ``torch.distributed.nn.functional.all_reduce``.

A step is forward + backward + ``SGD.step`` + ``zero_grad``; ``--warmup`` steps each, then
``--steps`` timed steps interleaved; medians of the slowest rank. Also reported: the bytes of expert
weights one rank holds against the whole model's (``1 / world``), and the collectives per step.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import hyper_parallel as hp  # noqa: E402
from _harness import (count_collectives, hp_collectives, launch, print_collective_rows,  # noqa: E402
                      print_time_rows, step, time_side_by_side)

EXPERTS = "model.layers.*.mlp.experts"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4, help="expert-parallel degree = processes (default 4)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--expert-intermediate", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch, split over the ranks (default 8)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per side (median reported)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank (default 1)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--overlap", action="store_true",
                   help="hp.ExpertParallel(overlap=True): two token chunks, all-to-alls overlapped with experts")
    p.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    return p.parse_args(argv)


def build_moe(args):
    from hyper_parallel.models.moe import MoEConfig, MoEForCausalLM

    config = MoEConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(128, args.seq_len), num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.expert_intermediate,
    )
    torch.manual_seed(0)
    return MoEForCausalLM(config)


def _eager_expert_forward(module, original_forward, num_experts: int, world: int, group):
    """The experts module's forward under eager expert parallelism (module docstring)."""
    from torch.distributed.nn.functional import all_to_all_single

    local = num_experts // world

    def forward(x, top_k_index, top_k_weights):
        tokens, k = top_k_index.shape
        ids = top_k_index.reshape(-1)
        order = torch.argsort(ids, stable=True)
        rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
        counts = torch.bincount(ids, minlength=num_experts)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=group)
        send = counts.view(world, local).sum(1).tolist()
        receive = received_counts.view(world, local).sum(1).tolist()
        received = all_to_all_single(rows.new_empty(sum(receive), rows.shape[1]), rows, receive, send, group=group)
        local_ids = torch.repeat_interleave(torch.arange(local).repeat(world), received_counts)
        outputs = original_forward(received, local_ids.unsqueeze(1),
                                   torch.ones(received.shape[0], 1, dtype=top_k_weights.dtype))
        back = all_to_all_single(outputs.new_empty(tokens * k, outputs.shape[1]), outputs, send, receive, group=group)
        per_choice = torch.empty_like(back).index_copy(0, order, back)
        return (per_choice.view(tokens, k, -1) * top_k_weights.unsqueeze(-1)).sum(1).to(x.dtype)

    return forward


def _global_load_balancing_loss(scores, top_k_index):
    """models.moe.load_balancing_loss over the whole batch: its two per-expert sums all-reduced."""
    from torch.distributed.nn.functional import all_reduce

    num_experts = scores.shape[-1]
    routed = (top_k_index.unsqueeze(-1) == torch.arange(num_experts)).sum((0, 1)).float()
    sums = all_reduce(torch.cat([routed, scores.sum(0).float(),
                                 torch.tensor([top_k_index.numel(), scores.shape[0]], dtype=torch.float32)]))
    routed, prob_sum, counts = sums[:num_experts], sums[num_experts:2 * num_experts], sums[2 * num_experts:]
    return num_experts * ((routed / counts[0]) * (prob_sum / counts[1])).sum()


def eager_expert_parallel(model, args, rank: int, world: int):
    """The eager reference: local expert slices, all-to-all forward, DDP over the dense parameters."""
    from torch.nn.parallel import DistributedDataParallel

    from hyper_parallel.models.moe import MoEBlock

    local = args.experts // world
    expert_names = []
    for fqn, module in model.named_modules():
        if fqn.endswith("mlp.experts"):
            for name, p in list(module.named_parameters()):
                shard = torch.nn.Parameter(p.detach()[rank * local:(rank + 1) * local].clone())
                shard.register_hook(lambda g: g / world)  # the loss is each rank's local mean
                setattr(module, name, shard)
                expert_names.append(f"{fqn}.{name}")
            original = module.forward
            module.num_experts = local
            module.forward = _eager_expert_forward(module, original, args.experts, world, dist.group.WORLD)
    for module in model.modules():
        if isinstance(module, MoEBlock):  # the whole batch's aux loss, as hp (and one device) computes it
            module.aux_loss_fn = _global_load_balancing_loss
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, expert_names)
    return DistributedDataParallel(model), expert_names


def _expert_bytes(model, names) -> int:
    params = dict(model.named_parameters())
    total = 0
    for name in names:
        p = params[name]
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def run(args: argparse.Namespace) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    if args.batch % world or args.experts % world:
        raise ValueError(f"--batch {args.batch} and --experts {args.experts} must be multiples of --world {world}")
    ref = build_moe(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len))
    local_ids = ids.chunk(world, dim=0)[rank]
    batch = {"input_ids": local_ids, "labels": local_ids}
    ref_loss0 = ref(input_ids=ids, labels=ids)["loss"].item()
    expert_names = [n for n, _ in ref.named_parameters() if ".mlp.experts." in n]
    total_expert_bytes = _expert_bytes(ref, expert_names)

    mesh = hp.init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    hp_model = hp.parallelize(copy.deepcopy(ref), {"expert_parallel": {EXPERTS: hp.ExpertParallel(overlap=args.overlap)}},
                              mesh)
    hp_opt = torch.optim.SGD(hp_model.parameters(), lr=args.lr)
    eager, eager_expert_names = eager_expert_parallel(copy.deepcopy(ref), args, rank, world)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=args.lr)

    measured = time_side_by_side((hp_model, hp_opt), (eager, eager_opt), batch, args.warmup, args.steps)
    counted = count_collectives({"hyper_parallel": (hp_model, hp_opt), "eager": (eager, eager_opt)}, batch)
    hp_loss_end = step(hp_model, hp_opt, batch).item()
    eager_loss_end = step(eager, eager_opt, batch)
    dist.all_reduce(eager_loss_end)
    hp_expert_bytes = _expert_bytes(hp_model, expert_names)
    eager_expert_bytes = _expert_bytes(eager.module, eager_expert_names)
    if rank != 0:
        return None
    hp_times, eager_times = measured.hp_times, measured.peer_times
    hp_med, eager_med = statistics.median(hp_times), statistics.median(eager_times)
    summary = hp_model.compile_summary()
    return {
        "bench": "ep_step",
        "world_size": world,
        "mesh": {"ep": world},
        "config": {
            "hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
            "vocab": args.vocab, "experts": args.experts, "top_k": args.top_k,
            "expert_intermediate": args.expert_intermediate, "seq_len": args.seq_len,
            "global_batch": args.batch, "local_batch": args.batch // world,
            "params": sum(p.numel() for p in ref.parameters()), "hp_overlap": args.overlap,
        },
        "threads_per_rank": args.threads,
        "warmup": args.warmup,
        "steps": args.steps,
        "torch": torch.__version__,
        "loss_step0": {"single_device": ref_loss0, "hyper_parallel": measured.hp_loss0,
                       "eager_mean_of_ranks": measured.peer_loss0},
        "loss_after_steps": {"hyper_parallel": hp_loss_end, "eager_mean_of_ranks": eager_loss_end.item() / world},
        "hp_first_step_s (compile + step)": measured.hp_first_step_s,
        "step_time_s": {
            "hyper_parallel": {"median": hp_med, "min": min(hp_times), "max": max(hp_times), "all": hp_times},
            "eager_ep": {"median": eager_med, "min": min(eager_times), "max": max(eager_times), "all": eager_times},
        },
        "ratio_hp_over_eager": hp_med / eager_med,
        "expert_weight_bytes_rank0": {"whole_model": total_expert_bytes, "hyper_parallel": hp_expert_bytes,
                                      "eager_ep": eager_expert_bytes,
                                      "hp_fraction": hp_expert_bytes / total_expert_bytes},
        "collectives_per_step": {
            "hyper_parallel (compile_summary)": hp_collectives(summary),
            "hyper_parallel (counted)": counted["hyper_parallel"],
            "eager (counted)": counted["eager"],
        },
        "fallbacks": summary.get("fallbacks", []),
    }


def print_table(r: dict) -> None:
    c = r["config"]
    print(f"\nEP ep={r['world_size']} MoE {c['layers']}L h{c['hidden']}, {c['experts']} experts top-{c['top_k']} "
          f"(width {c['expert_intermediate']}), {c['params']:,} params, global batch {c['global_batch']} "
          f"({c['local_batch']}/rank) x seq {c['seq_len']}, hp overlap {c['hp_overlap']}, "
          f"{r['threads_per_rank']} thread/rank, median of "
          f"{r['steps']} steps (slowest rank)")
    l0, le = r["loss_step0"], r["loss_after_steps"]
    print(f"loss at step 0: single device {l0['single_device']:.6f}, hp {l0['hyper_parallel']:.6f}, eager "
          f"(mean of ranks) {l0['eager_mean_of_ranks']:.6f}; after the timed steps hp {le['hyper_parallel']:.6f}, "
          f"eager {le['eager_mean_of_ranks']:.6f}; hp first step (compile + step) "
          f"{r['hp_first_step_s (compile + step)']:.1f} s")
    print(f"{'':26}{'hyper_parallel':>16}{'eager EP':>16}{'hp/eager':>10}")
    print_time_rows(r["step_time_s"], "eager_ep", r["ratio_hp_over_eager"])
    e = r["expert_weight_bytes_rank0"]
    print(f"{'expert weights MB/rank':26}{e['hyper_parallel'] / 1e6:>16.2f}{e['eager_ep'] / 1e6:>16.2f}"
          f"   (whole model {e['whole_model'] / 1e6:.2f} MB; hp holds {e['hp_fraction']:.3f})")
    colls = r["collectives_per_step"]
    print_collective_rows(colls["hyper_parallel (compile_summary)"], colls["hyper_parallel (counted)"],
                          colls["eager (counted)"])


def main(argv=None) -> None:
    args = parse_args(argv)
    launch(run, print_table, args, args.world, threads=args.threads)


if __name__ == "__main__":
    main()
