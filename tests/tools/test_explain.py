"""``hyper-parallel explain``: compile on torch's fake process-group backend (one process plays one
rank of a large mesh, meta tensors, nothing runs) and report memory and communication.

The numbers are checked against analytic values computed here from the Llama 3 8B shape (2 layers,
short sequences so each compile takes seconds), independently of the compiler: FSDP on 64 ranks and
Megatron TP on 8. Each ``explain`` call starts and destroys its own fake default process group;
the fixture below checks that none leaks into other test files.

Context parallelism (``--parallel ...,cp=N``, the last section): the presets' ``context_parallel``
entry, Ulysses all-to-all bytes, saved activations divided by cp, ring transfers on the simulated
timeline, and Llama 3 8B at 128k tokens fitting an H100 only with cp (the slow one: ~20 s on this
2-core host, almost all of it compiling 1 layer with cp=8 over 1M tokens).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from hyper_parallel.cost import get_profile
from hyper_parallel.tools import presets
from hyper_parallel.tools.cli import main
from hyper_parallel.tools.explain import explain, format_report

L = 2  # decoder layers (the 8B preset has 32)
BF16, FP32 = 2, 4


pytestmark = pytest.mark.usefixtures("no_process_group_leak")


def shapes_8b(layers: int = L) -> dict[str, list[tuple[int, ...]]]:
    """Parameter shapes of the Llama 3 8B shape per FSDP unit, from the published config."""
    h, ffn, vocab, heads, kv = 4096, 14336, 128256, 32, 8
    hd = h // heads
    layer = [(h,), (heads * hd, h), (kv * hd, h), (kv * hd, h), (h, heads * hd), (h,), (ffn, h), (ffn, h), (h, ffn)]
    return {**{f"layer{i}": layer for i in range(layers)}, "root": [(vocab, h), (h,), (vocab, h)]}


def padded_shard(shape: tuple[int, ...], n: int) -> int:
    """Elements of one rank's FSDP shard: dim 0 split in ceil(d0 / n) rows (padded as FSDP2)."""
    return math.ceil(shape[0] / n) * math.prod(shape[1:])


def test_fsdp_64_ranks_memory_and_collectives_match_analytic():
    n, batch, seq = 64, 1, 256
    report = explain(config="llama3-8b", num_layers=L, parallel="dp_shard=-1", world_size=n, plan="fsdp",
                     local_batch=batch, seq_len=seq, optimizer="adamw", hardware="h100")
    units = shapes_8b()
    shard = {u: sum(padded_shard(s, n) for s in shapes) for u, shapes in units.items()}

    mem = report["memory"]
    assert mem["params"] == sum(shard.values()) * FP32  # fp32 master shards
    assert mem["grads"] == sum(shard.values()) * FP32
    assert mem["optimizer_state"] == 2 * sum(shard.values()) * FP32  # AdamW: exp_avg, exp_avg_sq
    assert 0 < mem["saved_activations"] < mem["peak"]

    fwd, bwd = report["collectives"]["forward"], report["collectives"]["backward"]
    # Forward: one fused all-gather per unit of its bf16 shard.
    assert fwd["all_gather"]["dp_shard"] == {"count": L + 1, "bytes": sum(shard.values()) * BF16}
    # Backward (reshard_after_forward): every unit gathered again, except what backward does not
    # read: the embedding table (its gradient is an index-add of the output gradient).
    embedding = padded_shard(units["root"][0], n)
    assert bwd["all_gather"]["dp_shard"] == {"count": L + 1, "bytes": (sum(shard.values()) - embedding) * BF16}
    # One fused reduce-scatter per unit in fp32 (reduce_dtype): its input is the whole padded
    # unit (n shards); each rank keeps 1/n of it.
    assert bwd["reduce_scatter"]["dp_shard"] == {"count": L + 1, "bytes": n * sum(shard.values()) * FP32}
    # The loss: the summed loss and the global token count (reused by backward), two scalars
    # packed in one all-reduce, so the mean is over the global batch's tokens; nothing else.
    assert fwd["all_reduce"] == {"dp_shard": {"count": 1, "bytes": 8}}
    assert set(fwd) == {"all_gather", "all_reduce"} and set(bwd) == {"all_gather", "reduce_scatter"}

    assert report["device"]["memory_bytes"] > 0
    assert report["device"]["fits"] == (mem["peak"] <= report["device"]["memory_bytes"])
    assert report["batch"]["tokens_per_step"] == n * batch * seq
    text = format_report(report)
    assert "dp_shard=64" in text and "reduce_scatter" in text and "fits" in text


def test_megatron_tp_8_ranks_memory_and_collectives_match_analytic():
    tp, batch, seq, h, vocab = 8, 2, 256, 4096, 128256
    report = explain(config="llama3-8b", num_layers=L, parallel="tp=8", world_size=tp, plan="tp",
                     local_batch=batch, seq_len=seq, optimizer="adamw", rank=3)
    shapes = [s for unit in shapes_8b().values() for s in unit]
    sharded = sum(math.prod(s) for s in shapes if len(s) == 2)  # every matrix: colwise/rowwise/vocab
    replicated = sum(math.prod(s) for s in shapes if len(s) == 1)  # the RMSNorm weights
    per_rank = (sharded // tp + replicated) * BF16  # bf16 parameters (no FSDP master copy)

    mem = report["memory"]
    assert mem["params"] == per_rank
    assert mem["grads"] == per_rank
    assert mem["optimizer_state"] == 2 * per_rank

    fwd, bwd = report["collectives"]["forward"], report["collectives"]["backward"]
    activation = batch * seq * h * BF16
    # The cross-entropy runs on the vocab-sharded logits (fp32, every position): one fp32 value
    # per token for the log-softmax's max and exp-sum forward, the loss's partial sum (a scalar),
    # and the log-softmax backward's per-token sum.
    tokens = batch * seq * FP32  # the loss reads every position (the last one's label is ignored)
    # Forward: o_proj and down_proj partial sums per layer, plus the vocab-parallel embedding.
    assert fwd["all_reduce"] == {"tp": {"count": 2 * L + 1 + 3, "bytes": (2 * L + 1) * activation + 2 * tokens + FP32}}
    # Backward mirrors it: the q/k/v and gate/up input gradients (each group summed, then reduced
    # once) per layer, plus lm_head's input gradient.
    assert bwd["all_reduce"] == {"tp": {"count": 2 * L + 1 + 1, "bytes": (2 * L + 1) * activation + tokens}}
    # The vocab-sharded logits are never gathered: the loss runs on the shards and the caller gets
    # them as a DTensor; their gradients are local.
    assert set(fwd) == {"all_reduce"} and set(bwd) == {"all_reduce"}
    assert report["mesh"] == {"axes": {"tp": 8}, "world_size": 8, "rank": 3}


def test_megatron_sequence_parallel_8_ranks_collectives_match_analytic():
    tp, batch, seq, h = 8, 2, 256, 4096
    report = explain(config="llama3-8b", num_layers=L, parallel="tp=8", world_size=tp, plan="tp+sp",
                     local_batch=batch, seq_len=seq, rank=3)
    fwd, bwd = report["collectives"]["forward"], report["collectives"]["backward"]
    full, shard = batch * seq * h * BF16, batch * (seq // tp) * h * BF16  # residual stream: S(1)
    # Forward: the embedding and each o_proj / down_proj reduce-scatter to sequence shards; each
    # attention / MLP input and lm_head's input is all-gathered from them. The logits are never
    # gathered: the cross-entropy runs on the vocab shards, with per-token (fp32) all-reduces of
    # the log-softmax's max and exp-sum and the loss's partial sum, and the caller gets a DTensor.
    tokens = batch * seq * FP32
    assert fwd["reduce_scatter"] == {"tp": {"count": 2 * L + 1, "bytes": (2 * L + 1) * full}}
    assert fwd["all_gather"] == {"tp": {"count": 2 * L + 1, "bytes": (2 * L + 1) * shard}}
    assert fwd["all_reduce"] == {"tp": {"count": 3, "bytes": 2 * tokens + FP32}}
    # Backward transposes each: gathers for the reduce-scatters (the embedding's too: its
    # vocab-sharded weight gradient reads every position), reduce-scatters for the gathers but the
    # logits' (their gradients are local slices); the sequence-sharded norm weights' partial
    # gradients (2 per layer + the final norm) are all-reduced in one bucket; the log-softmax
    # backward's per-token sum.
    assert bwd["all_gather"] == {"tp": {"count": 2 * L + 1, "bytes": (2 * L + 1) * shard}}
    assert bwd["reduce_scatter"] == {"tp": {"count": 2 * L + 1, "bytes": (2 * L + 1) * full}}
    assert bwd["all_reduce"] == {"tp": {"count": 2, "bytes": (2 * L + 1) * h * BF16 + tokens}}


def test_sequence_parallel_preset_with_vocab_left_out_of_tensor_parallelism():
    # 1000 vocabulary rows: 500 per tp shard, which do not divide over dp_shard=8, so the preset
    # takes the embedding and lm_head out of TP; under SP lm_head's input is gathered first.
    config = {**presets.MODEL_PRESETS["llama3-8b"], "hidden_size": 256, "intermediate_size": 512,
              "num_attention_heads": 8, "num_hidden_layers": 1, "vocab_size": 1000}
    report = explain(config=config, parallel="dp_shard=-1,tp=2", world_size=16, plan="fsdp+tp+sp", seq_len=64)
    assert "500 vocabulary rows" in report["plan"]["notes"][0]
    fwd = report["collectives"]["forward"]
    batch, seq, h = 1, 64, 256
    # Per layer 2 sequence gathers (attention, MLP), then lm_head's input, each of a bf16 S(1) shard.
    assert fwd["all_gather"]["tp"] == {"count": 2 + 1, "bytes": 3 * batch * (seq // 2) * h * BF16}
    assert fwd["reduce_scatter"]["tp"]["count"] == 2  # o_proj, down_proj; the embedding is not TP


@pytest.mark.slow
def test_block_copy_with_the_embedding_left_out_of_tensor_parallelism(caplog):
    """The same preset at 3 layers: the replicated embedding's output is cut into sequence shards
    once, before the first block, so block 0's lowered program is block 1's and the block copy
    holds (it fell back to lowering every block: at Llama 3 8B on 1,024 ranks, dp_shard=128, the
    16,032 vocabulary rows of a tp=8 shard do not divide, and the compile took 59 s instead of 10).
    The copied program has the collectives of the one lowered block by block."""
    import logging

    config = {**presets.MODEL_PRESETS["llama3-8b"], "hidden_size": 256, "intermediate_size": 512,
              "num_attention_heads": 8, "num_hidden_layers": 3, "vocab_size": 1000}
    reports = {}
    for blocks in ("auto", None):
        with caplog.at_level(logging.INFO, logger="hyper_parallel"):
            caplog.clear()
            reports[blocks] = explain(config=config, parallel="dp_shard=-1,tp=2", world_size=16, plan="fsdp+tp+sp",
                                      seq_len=64, repeated_blocks=blocks)
        if blocks == "auto":
            assert "copy blocks" in caplog.text, caplog.text
            assert "every block" not in caplog.text, caplog.text
    assert reports["auto"]["collectives"] == reports[None]["collectives"]
    assert "500 vocabulary rows" in reports["auto"]["plan"]["notes"][0]


@pytest.mark.slow
def test_mfu_counts_model_flops_and_hfu_adds_recompute():
    config = {**presets.MODEL_PRESETS["llama3-8b"], "hidden_size": 512, "intermediate_size": 1024,
              "num_attention_heads": 8, "num_hidden_layers": 2, "vocab_size": 1024}
    none, full = (explain(config=config, parallel="dp_shard=-1", world_size=4, plan="fsdp", seq_len=128,
                          recompute=rc)["step"] for rc in ("none", "full"))
    assert none["recompute_flops"] == 0 and none["mfu"] == none["hfu"]
    # Full recompute runs each layer's forward again: those FLOPs are hardware, not model, FLOPs.
    assert full["recompute_flops"] > 0
    assert full["model_flops"] == none["flops"] == full["flops"] - full["recompute_flops"]
    assert full["hfu"] > full["mfu"]


@pytest.mark.slow
def test_cost_model_step_time_and_mfu_when_available():
    config = {**presets.MODEL_PRESETS["llama3-8b"], "hidden_size": 256, "intermediate_size": 512,
              "num_attention_heads": 8, "num_hidden_layers": 2, "vocab_size": 1024}
    report = explain(config=config, parallel="dp_shard=-1,tp=2", world_size=16, plan="fsdp+tp", seq_len=128,
                     hardware="a100")
    step = report["step"]
    assert step["available"] and step["profile"] == "a100"
    assert step["step_s"] > 0 and 0 < step["mfu"] < 1 and step["flops"] > 0
    assert step["exposed_comm_s"] <= step["comm_s"]
    # The per-call agreement over the 16 ranks: 4 host rounds, waited for at the forward's first
    # collective (FSDP's first all-gather, at once).
    assert step["agreement_s"] == pytest.approx(4 * get_profile("a100").host_message_latency_s)
    assert 0 < step["agreement_exposed_s"] <= step["agreement_s"]
    text = format_report(report)
    assert "step time (cost model, a100)" in text
    assert "per-call agreement over 16 ranks: 120 us (4 host message rounds)" in text


def test_when_the_cost_model_fails_memory_and_collectives_still_work(monkeypatch):
    import hyper_parallel.analysis.debug

    def fail(*args, **kwargs):
        raise RuntimeError("no time for this graph")

    monkeypatch.setattr(hyper_parallel.analysis.debug, "simulate_step", fail)
    config = {**presets.MODEL_PRESETS["llama3-8b"], "hidden_size": 256, "intermediate_size": 512,
              "num_attention_heads": 8, "num_hidden_layers": 1, "vocab_size": 1024}
    report = explain(config=config, parallel="dp_shard=-1", world_size=4, plan="fsdp", seq_len=64, hardware="h200")
    assert report["step"] == {"available": False, "reason": "the cost model failed: RuntimeError: no time for this graph"}
    assert report["device"]["memory_bytes"] == 141 * 10**9
    assert report["memory"]["params"] > 0 and report["collectives"]["per_step"]
    assert "step time: cost model not available" in format_report(report)


@pytest.mark.slow
def test_hsdp_collectives_are_labelled_by_axis_names():
    config = {**presets.MODEL_PRESETS["llama3-8b"], "hidden_size": 256, "intermediate_size": 512,
              "num_attention_heads": 8, "num_hidden_layers": 1, "vocab_size": 1024}
    report = explain(config=config, parallel="dp_replicate=2,dp_shard=-1,tp=2", world_size=16, plan="fsdp+tp",
                     seq_len=64)
    per_step = report["collectives"]["per_step"]
    axes = {axis for per_axis in per_step.values() for axis in per_axis}
    # The loss reduction runs over ParallelDims' flattened "dp" (dp_replicate x dp_shard) group.
    assert axes == {"dp", "dp_replicate", "dp_shard", "tp"}
    assert per_step["all_reduce"]["dp_replicate"]["count"] == 2  # HSDP: one per unit after its RS


def test_cli_hardware_takes_a_calibrated_profile_file(tmp_path, capsys):
    """``--hardware FILE.json`` (what ``hyper-parallel calibrate --out`` writes): the report names the
    file's profile and prices the step with its numbers; a bad name says what is accepted."""
    import dataclasses

    from hyper_parallel.cost import hardware

    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"base": "llama3-8b", "hidden_size": 64, "intermediate_size": 128,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
                                  "vocab_size": 256}))
    slow = dataclasses.replace(hardware.CPU, name="slow-cpu", peak_flops={"fp32": 1e9, "bf16": 1e9, "fp16": 1e9})
    path = hardware.save_profile(slow, str(tmp_path / "slow.json"))
    steps = {}
    for name in ("cpu", path):
        assert main(["explain", "--config", str(config), "--parallel", "dp_shard=-1", "--world-size", "2",
                     "--seq-len", "64", "--hardware", name, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        steps[name] = report["step"]
    assert steps[path]["profile"] == "slow-cpu" and steps["cpu"]["profile"] == "cpu"
    assert steps[path]["compute_s"] > steps["cpu"]["compute_s"]  # the file's 1 GFLOP/s, not the cpu profile's
    with pytest.raises(SystemExit):
        main(["explain", "--hardware", "tpu", "--world-size", "2"])
    assert "choose one of" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_json_plan_file_and_python_m(tmp_path, capsys):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"base": "llama3-8b", "hidden_size": 256, "intermediate_size": 512,
                                  "num_attention_heads": 8, "num_hidden_layers": 1, "vocab_size": 1024}))
    plan = tmp_path / "my_plan.py"
    plan.write_text("from hyper_parallel.models import llama_tp_plan\nplan = llama_tp_plan()\n")
    assert main(["explain", "--config", str(config), "--parallel", "dp_shard=-1,tp=2", "--world-size", "4",
                 "--plan", str(plan), "--seq-len", "64", "--optimizer", "sgd", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["fields"]["num_hidden_layers"] == 1 and report["plan"]["name"] == "my_plan.py"
    assert report["memory"]["optimizer_state"] == 0  # plain SGD keeps no state
    # Megatron, + the vocab-parallel loss (per-token max and exp-sum, the loss's partial sum).
    assert report["collectives"]["forward"]["all_reduce"]["tp"]["count"] == 2 * 1 + 1 + 3
    # A data-parallel axis without FSDP: the gradients are all-reduced over it.
    assert "dp_shard" in report["collectives"]["backward"]["all_reduce"]

    out = subprocess.run([sys.executable, "-m", "hyper_parallel", "explain", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "--world-size" in out and "fsdp+tp" in out


def test_hf_model_on_fake_backend():
    pytest.importorskip("transformers")
    config = {**presets.MODEL_PRESETS["llama3-8b"], "hidden_size": 256, "intermediate_size": 512,
              "num_attention_heads": 8, "num_hidden_layers": 1, "vocab_size": 1024}
    report = explain(model="hf:LlamaForCausalLM", config=config, parallel="dp_shard=-1", world_size=32,
                     plan="fsdp", seq_len=64)
    # 8 heads of 32 and 8 key/value heads: q, k, v and o are all 256 x 256.
    per_rank = sum(padded_shard(s, 32) for s in [(1024, 256), (256,), (1024, 256), (256,), (256, 256), (256, 256),
                                                   (256, 256), (256, 256), (256,), (512, 256), (512, 256), (256, 512)])
    assert report["memory"]["params"] == per_rank * FP32
    assert report["collectives"]["forward"]["all_gather"]["dp_shard"]["count"] == 2


def test_compile_for_explain_with_init_device_mesh():
    import torch

    import hyper_parallel as hp
    from hyper_parallel.tools.explain import compile_for_explain, fake_world
    from hyper_parallel.models import LlamaConfig, LlamaForCausalLM

    with fake_world(4, rank=2):
        mesh = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
        with hp.init_empty_weights():
            model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2))
        ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
        pmodel = compile_for_explain(model, {"fully_shard": {"units": ["model.layers.*", ""]}}, mesh,
                                     kwargs={"input_ids": ids, "labels": ids})
        assert all(p.to_local().is_meta for p in pmodel.parameters())  # nothing materialised
        assert pmodel.compile_summary()["collectives"]["forward"]["all_gather"]["dp_shard"]["count"] == 3
        forward, backward = pmodel.compiled_programs()
        assert len(forward.graph.nodes) and len(backward.graph.nodes)


# --- bad input: clear errors that name the value and the choices --------------------------------


@pytest.mark.parametrize("spec, named", [
    ("tp8", ["'tp8'", "KEY=VALUE", "dp_shard"]),
    ("tp=eight", ["'eight'", "not an integer"]),
    ("dp_shard=-1,zp=2", ["'zp'", "dp_replicate", "dp_shard", "tp"]),
    ("tp=2,tp=4", ["tp is given twice"]),
    ("", ["empty"]),
])
def test_bad_parallel_strings(spec, named):
    with pytest.raises(ValueError) as err:
        presets.parse_parallel(spec)
    for text in named:
        assert text in str(err.value)


def test_unknown_presets_name_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"'llama3-7b'.*llama3-405b, llama3-70b, llama3-8b"):
        presets.load_model_config("llama3-7b")
    with pytest.raises(ValueError, match=r"'zero3'.*fsdp, tp, fsdp\+tp, tp\+sp, fsdp\+tp\+sp"):
        presets.build_plan("zero3", {"dp_shard": 8}, {})
    with pytest.raises(ValueError, match=r"'fsdp' shards over the dp_shard axis"):
        presets.build_plan("fsdp", {"tp": 8}, {})


def test_unknown_hf_architecture():
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=r"hf:NoSuchModel.*no model class 'NoSuchModel'"):
        explain(model="hf:NoSuchModel", config={"num_hidden_layers": 1}, world_size=2)


def test_cli_errors_exit_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["explain", "--parallel", "dp_shard=-1,tq=8", "--world-size", "16"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown degree 'tq'" in err and "Traceback" not in err
    with pytest.raises(SystemExit):
        main(["explain", "--hardware", "tpu"])
    assert "--hardware: 'tpu': choose one of h100, h200, a100, ascend-910b, cpu or a profile .json file" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["explain", "--config", "llama3-8b", "--parallel", "tp=3", "--world-size", "3", "--plan", "tp"])
    assert "tp=3 does not divide" in capsys.readouterr().err


def test_cli_repeated_blocks_defaults_to_auto_and_none_turns_it_off(monkeypatch):
    """``--repeated-blocks`` reaches explain as parallelize takes it: "auto" unless told "none"."""
    import hyper_parallel.tools.explain as explain_module

    seen = []
    monkeypatch.setattr(explain_module, "explain", lambda **kwargs: seen.append(kwargs["repeated_blocks"]) or {})
    monkeypatch.setattr(explain_module, "format_report", lambda report: "")
    assert main(["explain"]) == 0 and main(["explain", "--repeated-blocks", "none"]) == 0
    assert seen == ["auto", None]


def test_fsdp_tp_preset_keeps_vocab_tp_only_when_fsdp_can_shard_it():
    even = presets.build_plan("fsdp+tp", {"dp_shard": 32, "tp": 8}, {"vocab_size": 128256})
    assert "lm_head" in even.plan["tensor_parallel"] and not even.notes
    uneven = presets.build_plan("fsdp+tp", {"dp_shard": 128, "tp": 8}, {"vocab_size": 128256})
    assert "lm_head" not in uneven.plan["tensor_parallel"]
    assert "model.embed_tokens" not in uneven.plan["tensor_parallel"]
    assert "16032 vocabulary rows" in uneven.notes[0]
    full = presets.build_plan("fsdp", {"dp_shard": 8}, {}, recompute="full")
    assert full.plan["recompute"] == {"model.layers.*": "full"}


@pytest.mark.slow
def test_trace_and_dump_dir_price_the_step_on_the_requested_hardware(tmp_path, capsys):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"base": "llama3-8b", "hidden_size": 256, "intermediate_size": 512,
                                  "num_attention_heads": 8, "num_hidden_layers": 1, "vocab_size": 1024}))
    dump, trace = tmp_path / "dump", tmp_path / "step.json"
    assert main(["explain", "--config", str(config), "--parallel", "dp_shard=-1,tp=2", "--world-size", "8",
                 "--plan", "fsdp+tp", "--seq-len", "64", "--hardware", "a100", "--rank", "1",
                 "--trace", str(trace), "--dump-dir", str(dump), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    events = json.loads(trace.read_text())["traceEvents"]
    comm = [e for e in events if e.get("cat") == "comm"]
    assert comm and all(e["pid"] == 1 for e in comm)
    # The dump's trace is the one explain simulated (a100, AdamW), not the cpu-profile default.
    assert json.loads((dump / "rank1" / "trace.json").read_text()) == json.loads(trace.read_text())
    assert main(["report", str(dump)]) == 0  # the only rank in the dump: 1
    assert json.loads((dump / "report.trace.json").read_text()) == json.loads(trace.read_text())
    assert (dump / "report.html").stat().st_size > 0
    # What the page prints is what explain printed: hardware, totals, memory with AdamW's state.
    from hyper_parallel.tools.report.data import find_rank, load_page_data

    page = load_page_data(find_rank(str(dump)))
    totals, memory = page["timeline"]["totals"], page["summary"]["memory"]
    assert totals["profile"] == report["step"]["profile"] == "a100"
    assert totals["step_s"] == report["step"]["step_s"] > 0 and totals["optimizer_model"] == "adamw"
    assert memory["peak"] == report["memory"]["peak"] and memory["optimizer_state"] > 0
    assert (memory["device"], memory["optimizer"]) == ("a100", "adamw")


@pytest.mark.slow
def test_fsdp_reduce_scatters_overlap_backward_in_the_simulated_step(tmp_path):
    """The 8B FSDP step (4 of its layers, bf16 compute / fp32 reduction, h100) as the cost model
    simulates it: each layer's reduce-scatter runs on the communication stream while the layers
    before it still run their backward matmuls (all but layers.0's, the last layer backward
    reaches, and the root's). When the gradient casts sat at the end of backward, every
    reduce-scatter started after the last backward matmul."""
    trace = tmp_path / "step.json"
    explain(config="llama3-8b", num_layers=4, world_size=8, seq_len=2048, trace_path=str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    backward = [e for e in events if e["args"].get("phase") == "backward"]
    last_matmul = max(e["ts"] + e["dur"] for e in backward
                      if e["cat"] == "compute" and e["args"]["op"] == "aten.mm.default")
    scatters = [e for e in backward if e["cat"] == "comm" and "reduce_scatter" in e["args"]["op"]]
    assert len(scatters) == 4 + 1  # one per layer and the root
    assert sum(e["ts"] < last_matmul for e in scatters) == 3, [(e["ts"], last_matmul) for e in scatters]


@pytest.mark.slow
def test_mixtral_expert_parallel_memory_and_all_to_all_match_analytic():
    """Mixtral 8x7B shape, one layer, dp_shard=2 x ep=4: each rank keeps 8/4 experts, FSDP-sharded
    over dp_shard (1 expert's worth of fp32 masters), dense weights FSDP-sharded over all eight
    data-parallel ranks (dp_shard x ep);
    per MoE layer forward exchanges the rows per expert (int64) and dispatches and combines
    T * top-k rows of hidden size in bf16, backward runs the two transposes."""
    h, ffn, vocab, heads, kv, experts, top_k = 4096, 14336, 32000, 32, 8, 8, 2
    n, ep, shard, batch, seq = 8, 4, 2, 1, 256
    report = explain(config="mixtral-8x7b", num_layers=1, parallel=f"dp_shard={shard},ep={ep}", world_size=n,
                     plan="fsdp", local_batch=batch, seq_len=seq, optimizer="adamw", hardware="h100")
    hd = h // heads
    dense = (2 * h + heads * hd * h + 2 * kv * hd * h + h * heads * hd + experts * h  # norms, q, k, v, o, router
             + 2 * vocab * h + h)  # embedding, lm_head, final norm
    expert_elems = 3 * experts * h * ffn
    assert report["memory"]["params"] == (dense // (shard * ep) + expert_elems // (ep * shard)) * FP32
    rows = batch * seq * top_k
    fwd, bwd = report["collectives"]["forward"], report["collectives"]["backward"]
    assert fwd["all_to_all"] == {"ep": {"count": 3, "bytes": experts * 8 + 2 * rows * h * BF16}}
    assert bwd["all_to_all"] == {"ep": {"count": 2, "bytes": 2 * rows * h * BF16}}
    assert report["batch"]["tokens_per_step"] == n * batch * seq  # ep ranks take different rows
    assert "ep=4" in format_report(report)


def test_ep_on_a_dense_model_is_refused():
    with pytest.raises(ValueError, match=r"--parallel ep=... spreads the experts of a mixture-of-experts model"):
        explain(config="llama3-8b", num_layers=1, parallel="dp_shard=2,ep=4", world_size=8, plan="fsdp",
                local_batch=1, seq_len=128)


# --- context parallelism: the sequence sharded over cp ------------------------------------------

# A narrow Llama 3 shape (grouped-query attention as the 8B: 8 query heads of 64 dims, 2 key/value
# heads) so the cp compiles take seconds: every weight 512 x 512 but k/v, since each distinct
# matmul shape costs DTensor's sharding propagation over strided shards ~1 s on this host.
SMALL = {"base": "llama3-8b", "hidden_size": 512, "intermediate_size": 512, "num_attention_heads": 8,
         "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 512}
HEADS, HEAD_DIM = 8, 64


def test_presets_add_context_parallel_on_a_cp_mesh():
    import hyper_parallel as hp

    assert presets.parse_parallel("dp_shard=8,cp=8") == {"dp_shard": 8, "cp": 8}
    attention = "model.layers.*.self_attn"
    ring = hp.ContextParallel(mode="ring", load_balance=True)
    fsdp = presets.build_plan("fsdp", {"dp_shard": 2, "cp": 4}, {})
    assert fsdp.plan["context_parallel"] == {attention: ring}
    assert "ring attention (3 K/V transfers" in fsdp.notes[0] and "load-balanced" in fsdp.notes[0]
    assert presets.build_plan("tp", {"cp": 2, "tp": 2}, {}).plan["context_parallel"] == {attention: ring}
    ulysses = presets.build_plan("fsdp+tp", {"dp_shard": 2, "cp": 2, "tp": 2}, {}, cp_mode="all_to_all")
    assert ulysses.plan["context_parallel"] == {attention: hp.ContextParallel(mode="all_to_all")}
    assert "context_parallel" not in presets.build_plan("fsdp", {"dp_shard": 8}, {}).plan
    with pytest.raises(ValueError, match=r"--cp-mode 'ulysses': choose one of ring, all_gather, all_to_all"):
        presets.build_plan("fsdp", {"dp_shard": 2, "cp": 4}, {}, cp_mode="ulysses")
    gathered = presets.build_plan("fsdp", {"dp_shard": 2, "cp": 4}, {}, cp_mode="all_gather")
    assert gathered.plan["context_parallel"] == {attention: hp.ContextParallel(mode="all_gather")}
    assert "all-gather attention (every cp rank's K/V gathered once" in gathered.notes[0]
    hybrid_gather = presets.build_plan("fsdp", {"dp_shard": 2, "cp": 8}, {}, cp_mode="all_gather", ulysses_degree=2)
    assert "all-gather attention over the 4 groups" in hybrid_gather.notes[0]
    hybrid = presets.build_plan("fsdp", {"dp_shard": 2, "cp": 8}, {}, ulysses_degree=2)
    assert hybrid.plan["context_parallel"] == {attention: hp.ContextParallel(mode="ring", ulysses_degree=2)}
    assert "all-to-all (Ulysses) inside groups of 2 cp ranks, ring attention over the 4 groups" in hybrid.notes[0]


@pytest.mark.slow
def test_hybrid_collectives_and_their_groups_in_the_simulated_step(tmp_path):
    """``--parallel dp_shard=2,cp=8,ulysses_degree=2``: per attention forward, 5 all-to-alls inside each pair
    of consecutive cp ranks (query, key, value ``[batch, heads, seq / 8, head dim]`` and output
    to and from ``heads / 2``; the log-sum-exp) and a ring of 4 pairs: 3 transfers of the pair's
    key and value for ``heads / 2`` and ``seq / 4`` tokens. The simulated step prices each on its
    own group: the pairs and the ring are sub-groups of cp, named ``cp/ulysses`` and ``cp/ring``."""
    seq, cp, u = 1024, 8, 2
    trace = tmp_path / "step.json"
    report = explain(config=SMALL, parallel=f"dp_shard=2,cp={cp},ulysses_degree={u}", world_size=2 * cp,
                     seq_len=seq, local_batch=1, trace_path=str(trace))
    assert report["plan"]["context_parallel"]["mode"] == "hybrid"
    fwd = report["collectives"]["forward"]
    rows = HEADS * (seq // cp)
    # Query, key and value in one all-to-all, the output with its log-sum-exp (as bf16 columns) in another.
    assert fwd["all_to_all"]["cp/ulysses"] == {"count": 2, "bytes": 4 * rows * HEAD_DIM * BF16 + rows * FP32}
    block = 2 * (HEADS // u) * (seq // (cp // u)) * HEAD_DIM * BF16
    assert fwd["send_recv"] == {"cp/ring": {"count": cp // u - 1, "bytes": (cp // u - 1) * block}}
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    names = {e["name"] for e in events if e["cat"] == "comm"}
    assert {"send_recv[cp/ring]", "all_to_all[cp/ulysses]"} <= names, names
    assert "ring attention over 4 groups of 2 all-to-all ranks, cp=8" in format_report(report)


@pytest.mark.slow
def test_cli_cp_all_to_all_collectives_and_batch_match_analytic(tmp_path, capsys):
    """``--parallel dp_shard=2,cp=4 --cp-mode all_to_all`` (Ulysses) through the CLI. Per attention
    forward: query, key, value and output ``[local batch, heads, seq / cp, head dim]`` (bf16) and
    the log-sum-exp (fp32, no head dim) over cp, in two all-to-alls (query, key and value packed;
    the output with the log-sum-exp's bytes as bf16 columns). Key and value carry all 8
    query heads, not the 2 key/value heads: the example Llama repeats them before attention. cp
    ranks share sequences: the global batch counts dp_shard only."""
    config = tmp_path / "small.json"
    config.write_text(json.dumps(SMALL))
    batch, seq, cp = 2, 512, 4
    assert main(["explain", "--config", str(config), "--parallel", f"dp_shard=2,cp={cp}", "--world-size", "8",
                 "--seq-len", str(seq), "--local-batch", str(batch), "--cp-mode", "all_to_all", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["context_parallel"] == {"axis": "cp", "degree": cp, "mode": "all_to_all", "ulysses": cp,
                                                  "load_balance": False, "asynchronous": False, "kv_exchange": None,
                                                  "modules": 1}
    assert report["batch"] == {"local_batch": batch, "seq_len": seq, "global_batch": 2 * batch,
                               "tokens_per_step": 2 * batch * seq}
    fwd = report["collectives"]["forward"]
    rows = batch * HEADS * (seq // cp)
    assert fwd["all_to_all"] == {"cp": {"count": 2, "bytes": 4 * rows * HEAD_DIM * BF16 + rows * FP32}}
    assert "send_recv" not in fwd
    # FSDP over dp_shard x cp gathers on the flattened group, named by its axes.
    assert "dp_shard+cp" in fwd["all_gather"]
    assert "dp_shard+cp" in report["collectives"]["backward"]["reduce_scatter"]
    text = format_report(report)
    assert "all-to-all attention over cp=4" in text and "each of 4 cp ranks holds 128 tokens" in text


@pytest.mark.slow
def test_cp_divides_saved_activations_per_rank():
    """Saved-for-backward bytes with cp=4 are at most 0.3 of those without cp. Isolating the
    effect: the same 8 ranks, dp_shard=2 x cp=4 against dp_shard=8, so FSDP shards the weights
    over 8 ranks either way (parameters, gradients and optimizer state are equal, checked), the
    same 2 sequences of 1024 tokens per data-parallel rank; with cp each rank holds 256 tokens of
    each instead of 1024. What cp adds (ring buffers, the log-sum-exp) keeps the ratio above 1/4."""
    common = dict(config=SMALL, world_size=8, local_batch=2, seq_len=1024)
    with_cp = explain(parallel="dp_shard=2,cp=4", **common)
    without = explain(parallel="dp_shard=8", **common)
    for key in ("params", "grads", "optimizer_state"):
        assert with_cp["memory"][key] == without["memory"][key]
    ratio = with_cp["memory"]["saved_activations"] / without["memory"]["saved_activations"]
    assert 0.25 <= ratio <= 0.3, ratio
    assert with_cp["memory"]["peak"] < without["memory"]["peak"]
    assert with_cp["plan"]["context_parallel"]["mode"] == "ring" and with_cp["plan"]["context_parallel"]["load_balance"]
    assert with_cp["batch"]["tokens_per_step"] == without["batch"]["tokens_per_step"] // 4  # dp 2, not 8


@pytest.mark.slow
def test_ring_transfers_are_priced_and_overlapped_in_the_simulated_step(tmp_path):
    """``hp.AsyncContextParallel`` on cp=4 (a plan file; 2 layers): the simulated step's timeline
    holds cp − 1 = 3 send_recv transfers over cp per attention forward, each of key and value
    stacked, ``2 x batch x heads x seq / cp x head dim`` bf16 elements (query heads: the example
    Llama repeats key/value before attention), and each runs while an attention block computes;
    with ``ContextParallel(mode="ring")`` each is waited for before the next block's attention."""
    layers, seq, cp = 2, 1024, 4
    block = 2 * 1 * HEADS * (seq // cp) * HEAD_DIM * BF16
    overlapped, exposed = {}, {}
    for style in ("AsyncContextParallel()", "ContextParallel(mode='ring')"):
        plan, trace = tmp_path / "plan.py", tmp_path / "step.json"
        plan.write_text(f"import hyper_parallel as hp\nplan = {{'context_parallel': "
                        f"{{'model.layers.*.self_attn': hp.{style}}}}}\n")
        report = explain(config={**SMALL, "num_hidden_layers": layers}, parallel=f"cp={cp}", world_size=cp,
                         plan=str(plan), seq_len=seq, trace_path=str(trace))
        assert report["collectives"]["forward"]["send_recv"] == {"cp": {"count": layers * (cp - 1),
                                                                        "bytes": layers * (cp - 1) * block}}
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
        forward = [e for e in events if e["args"]["phase"] == "forward"]
        transfers = [e for e in forward if e["cat"] == "comm" and e["name"].startswith("send_recv")]
        assert len(transfers) == layers * (cp - 1)
        assert {e["name"] for e in transfers} == {"send_recv[cp]"}
        assert {e["args"]["bytes"] for e in transfers} == {block} and all(e["dur"] > 0 for e in transfers)
        attention = [e for e in forward if e["cat"] == "compute" and "scaled_dot_product" in e["args"]["op"]]
        exposed[style] = report["step"]["exposed_comm_s"]
        eps = 1e-3  # µs: the sync ring's attention starts where its transfer ends (float rounding)
        overlapped[style] = sum(
            any(a["ts"] < t["ts"] + t["dur"] - eps and t["ts"] < a["ts"] + a["dur"] - eps for a in attention)
            for t in transfers)
    assert overlapped == {"AsyncContextParallel()": layers * (cp - 1), "ContextParallel(mode='ring')": 0}
    assert exposed["AsyncContextParallel()"] < exposed["ContextParallel(mode='ring')"]


@pytest.mark.slow
def test_all_gather_attention_is_counted_and_named():
    """``--cp-mode all_gather`` on dp_shard=2 x cp=4 (2 layers): per attention forward one gather of
    every cp rank's key and value (this rank sends its bf16 block, ``2 x heads x seq / cp x head
    dim``), backward one more and one reduce-scatter of this rank's fp32 dK/dV shares of all cp
    blocks; no ring transfer. The report names the mode."""
    layers, seq, cp = 2, 1024, 4
    report = explain(config={**SMALL, "num_hidden_layers": layers}, parallel=f"dp_shard=2,cp={cp}", world_size=8,
                     seq_len=seq, cp_mode="all_gather")
    block = 2 * HEADS * (seq // cp) * HEAD_DIM * BF16
    labels = (seq // cp) * 8  # the labels' one-token shift: int64 labels of this rank's tokens
    forward, backward = report["collectives"]["forward"], report["collectives"]["backward"]
    assert forward["all_gather"]["cp"] == {"count": layers + 1, "bytes": layers * block + labels}
    assert backward["all_gather"]["cp"] == {"count": layers, "bytes": layers * block}
    assert backward["reduce_scatter"]["cp"] == {"count": layers, "bytes": layers * cp * 2 * block}  # fp32 shares
    assert "send_recv" not in forward and "send_recv" not in backward
    assert report["plan"]["context_parallel"]["kv_exchange"] == "all_gather"
    assert "all-gather attention over cp=4 (load-balanced)" in format_report(report)


@pytest.mark.slow
def test_llama3_8b_at_128k_tokens_fits_an_h100_only_with_cp():
    """Llama 3 8B, 131072-token sequences, full recompute, 64 simulated H100s: dp_shard=8 x cp=8
    fits, dp_shard=64 (the same ranks, cp replaced by data parallelism) does not. Measured with all
    32 layers (``hyper-parallel explain --config llama3-8b --seq-len 131072 --parallel
    dp_shard=8,cp=8 --world-size 64 --recompute full``): peak 41.5 GiB against 288 GiB without
    cp; compiling the cp one took 143 s here, so this test compiles 1 layer (whose cp compile still
    takes ~35-60 s: DTensor's sharding propagation of each matmul over strided shards of the 1M
    tokens, a cost that barely depends on the layer count). More layers only add memory, so "does
    not fit" at 1 layer holds at 32; "fits" is checked with 31 more layers' worth added to the
    1-layer peak: their FSDP shards of fp32 parameters, gradients and AdamW state and, under full
    recompute, each layer's saved bf16 input (16384 tokens of 4096 per cp rank)."""
    common = dict(config="llama3-8b", num_layers=1, world_size=64, seq_len=131072, recompute="full")
    with_cp = explain(parallel="dp_shard=8,cp=8", **common)
    without = explain(parallel="dp_shard=64", **common)
    device = with_cp["device"]["memory_bytes"]
    assert not without["device"]["fits"] and without["memory"]["peak"] > 3 * device
    layer_params = sum(math.prod(s) for s in shapes_8b(1)["layer0"])
    per_layer = layer_params * (FP32 + FP32 + 2 * FP32) // 64 + (131072 // 8) * 4096 * BF16
    assert with_cp["device"]["fits"]
    assert with_cp["memory"]["peak"] + 31 * per_layer < device
    assert with_cp["batch"]["tokens_per_step"] == 8 * 131072
    assert with_cp["collectives"]["forward"]["send_recv"]["cp"]["count"] == 8 - 1


@pytest.mark.slow
def test_cp_with_fewer_sequences_than_cp_ranks():
    """dp_shard=2 x cp=4 with one sequence per data-parallel rank (2 sequences over 4 cp ranks, the
    long-context configuration): DTensor's view rule refuses the [batch * sequence] rows back to
    [batch, sequence] there; propagation/strided_views.py decides that view, so it compiles, with
    each rank holding a quarter of its one sequence."""
    report = explain(config=SMALL, parallel="dp_shard=2,cp=4", world_size=8, seq_len=512)
    assert report["batch"]["global_batch"] == 2 and report["plan"]["context_parallel"]["degree"] == 4


@pytest.mark.slow
def test_cpu_ranks_beyond_the_host_cores_take_longer():
    """4 ranks on a 2-core host (the cpu profile with 4 ranks per node): every simulated time
    twice one rank's with a core of its own, MFU half, and the report says why."""
    import dataclasses

    from hyper_parallel.cost.hardware import CPU

    shared, own = (explain(config="llama3-8b", num_layers=1, parallel="dp_shard=-1", world_size=4, plan="fsdp",
                           local_batch=1, seq_len=64, hardware=dataclasses.replace(CPU, devices_per_node=4, host_cores=cores))
                   for cores in (2, None))
    assert shared["step"]["host_sharing"] == 2.0 and "host_sharing" not in own["step"]
    for key in ("step_s", "compute_s", "forward_s", "backward_s"):
        assert shared["step"][key] == pytest.approx(2 * own["step"][key])
    assert shared["step"]["mfu"] == pytest.approx(own["step"]["mfu"] / 2)
    assert "ranks share the host's 2 cores: times x2.00" in format_report(shared)
