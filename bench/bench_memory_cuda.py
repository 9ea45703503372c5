"""Peak memory at a real layer shape on one GPU: hyper_parallel's estimate next to what the CUDA
caching allocator measured, for hyper_parallel and for PyTorch FSDP2 with the same policy.

What it answers: does the estimator (``ParallelModule.memory_report``, the number ``hyper-parallel
explain`` scales to clusters) predict the allocator's peak at a production layer shape (Llama 3 8B
layers: hidden 4096, MLP 14336, 32 heads / 8 KV heads, vocab 128256, 8192 tokens), with bf16
parameters, fp32 reduction, AdamW and full recompute; how much the allocator *reserves* above that
peak (what published runs report, with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` as
torchtitan sets it, and with the default allocator); and whether our program needs more memory
than FSDP2 running the same model.

Each case runs in its own process (the caching allocator keeps what an earlier case reserved, so two
cases in one process would share one reserved peak): one NCCL rank, a mesh of one (our FSDP
program then holds no collectives; FSDP2 still copies through its buffers). A case builds the
example Llama on the device from seed 0, takes ``--warmup`` steps (forward, backward, AdamW step,
``zero_grad``), then measures one step's ``max_memory_allocated`` / ``max_memory_reserved`` and the
median time of ``--steps`` more. hyper_parallel's case also reports its estimate (the program's
peak with the real AdamW state), the ratio of measured to estimated peak, and the reserved peak
the allocator model (``analysis/allocator_model.py``) predicts for the case's allocator mode.

``python bench/bench_memory_cuda.py`` runs the default cases on CUDA; ``--device cpu`` with small
``--hidden`` etc. checks the script on a machine without a GPU (no allocator numbers then).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.utils.checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

CASES = [  # (side, recompute, PYTORCH_CUDA_ALLOC_CONF)
    ("hp", "full", "expandable_segments:True"),
    ("fsdp2", "full", "expandable_segments:True"),
    ("hp", "full", ""),
    ("hp", "none", "expandable_segments:True"),
    ("fsdp2", "none", "expandable_segments:True"),
]


def parse_args(argv=None) -> argparse.Namespace:
    from _harness import add_model_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.set_defaults(hidden=4096, intermediate=14336, layers=4, heads=32, kv_heads=8, vocab=128256, seq_len=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--case", nargs=3, metavar=("SIDE", "RECOMPUTE", "ALLOC_CONF"), default=None,
                   help="run one case in this process (the driver passes it; ALLOC_CONF '-' for default)")
    p.add_argument("--sides", nargs="+", choices=["hp", "fsdp2"], default=["hp", "fsdp2"])
    p.add_argument("--timeout", type=float, default=240, help="seconds per case")
    p.add_argument("--json-out", default=None)
    return p.parse_args(argv)


class Checkpointed(torch.nn.Module):
    """A block whose forward is ``torch.utils.checkpoint`` of the wrapped one: full recompute for
    FSDP2, as torchtitan's ``ac_mode="full"`` applies it."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def _model(args, side: str, recompute: str):
    import torch.distributed as dist

    import hyper_parallel as hp
    from _harness import build_model

    with torch.device(args.device):
        model = build_model(args)
    policy_kw = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    if side == "hp":
        mesh = hp.init_device_mesh(args.device, (dist.get_world_size(),), mesh_dim_names=("dp",))
        plan = {"fully_shard": hp.FullyShard(units=("model.layers.*", ""),
                                            mixed_precision=hp.MixedPrecisionPolicy(**policy_kw))}
        if recompute != "none":
            plan["recompute"] = {"model.layers.*": recompute}
        return hp.parallelize(model, plan, mesh)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(args.device, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(**policy_kw)
    for i, layer in enumerate(model.model.layers):
        if recompute == "full":
            layer = model.model.layers[i] = Checkpointed(layer)
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def run_case(args) -> dict:
    """One case in this process: the numbers as a dict (printed as the last line by main)."""
    import torch.distributed as dist

    from _harness import step

    side, recompute, _ = args.case
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        t0 = time.perf_counter()
        model = _model(args, side, recompute)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        torch.manual_seed(1)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=args.device)
        labels = ids.clone()
        labels[:, : args.seq_len // 8] = -100  # padded labels, as real batches have
        batch = {"input_ids": ids, "labels": labels}
        losses = [step(model, opt, batch).item() for _ in range(args.warmup)]
        setup_s = time.perf_counter() - t0
        result = {"side": side, "recompute": recompute, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                  "losses": losses, "setup_and_warmup_s": setup_s,
                  "params": sum(p.numel() for p in model.parameters())}
        if cuda:
            torch.cuda.synchronize()
            result["allocated_before_step"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step(model, opt, batch)
            torch.cuda.synchronize()
            result["max_allocated"] = torch.cuda.max_memory_allocated()
            result["max_reserved"] = torch.cuda.max_memory_reserved()
        times = []
        for _ in range(args.steps):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            step(model, opt, batch)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        result["step_s_median"] = statistics.median(times)
        if side == "hp":
            # The step drops the forward's outputs at once (``model(...)["loss"]``): estimated so,
            # and also as a loop that keeps ``out`` (the logits) through backward would need.
            est = model.memory_report(opt, keep_outputs=False)
            result["estimated_peak"] = est["peak"]
            result["estimated_peak_site"] = est["peak_site"]["where"]
            result["estimated_peak_keeping_outputs"] = model.memory_report(opt)["peak"]
            # What the caching allocator reserves, predicted (analysis/allocator_model.py) for this case's mode.
            expandable = "expandable_segments:True" in result["alloc_conf"]
            result["estimated_reserved"] = est["reserved_expandable" if expandable else "reserved_default"]
            if cuda:
                result["measured_over_estimated"] = result["max_allocated"] / est["peak"]
        return result
    finally:
        dist.destroy_process_group()


def _run_subprocess(args, argv, case) -> dict:
    """``case`` in a process of its own, with the driver's command line (``argv``) plus ``--case``."""
    side, recompute, conf = case
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--case", side, recompute, conf or "-"]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"side": side, "recompute": recompute, "alloc_conf": conf, "error": f"timed out after {args.timeout} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"side": side, "recompute": recompute, "alloc_conf": conf,
                "error": f"rc {done.returncode}: {done.stderr.strip()[-2000:]}"}
    return json.loads(lines[-1])


def _gib(n) -> str:
    return f"{n / 2**30:.2f}" if isinstance(n, (int, float)) else "-"


def report(results: list[dict]) -> None:
    print(f"{'side':6} {'recompute':9} {'alloc conf':26} {'estimate':>9} {'allocated':>9} {'reserved':>9}"
          f" {'meas/est':>8} {'res. est':>9} {'step s':>7}  (GiB)")
    for r in results:
        if "error" in r:
            print(f"{r['side']:6} {r['recompute']:9} {r['alloc_conf'] or 'default':26} ERROR {r['error']}")
            continue
        ratio = r.get("measured_over_estimated")
        print(f"{r['side']:6} {r['recompute']:9} {r['alloc_conf'] or 'default':26} {_gib(r.get('estimated_peak')):>9}"
              f" {_gib(r.get('max_allocated')):>9} {_gib(r.get('max_reserved')):>9}"
              f" {'-' if ratio is None else format(ratio, '.3f'):>8} {_gib(r.get('estimated_reserved')):>9}"
              f" {r['step_s_median']:7.3f}")
    by = {(r["side"], r["recompute"], r["alloc_conf"]): r for r in results if "error" not in r}
    for recompute in ("full", "none"):
        hp_r = by.get(("hp", recompute, "expandable_segments:True"))
        peer = by.get(("fsdp2", recompute, "expandable_segments:True"))
        if hp_r and peer and "max_allocated" in hp_r:
            print(f"recompute {recompute}: hp / FSDP2 allocated peak {hp_r['max_allocated'] / peer['max_allocated']:.3f},"
                  f" reserved {hp_r['max_reserved'] / peer['max_reserved']:.3f},"
                  f" step time {hp_r['step_s_median'] / peer['step_s_median']:.3f};"
                  f" step-0 loss hp {hp_r['losses'][0]:.5f} FSDP2 {peer['losses'][0]:.5f}")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.case is not None:
        print(json.dumps(run_case(args)))
        return
    results = []
    for case in [c for c in CASES if c[0] in args.sides]:
        r = _run_subprocess(args, argv, case)
        print(json.dumps(r), flush=True)
        results.append(r)
    report(results)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
