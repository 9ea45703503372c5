"""Failure behaviour of real runs: what goes wrong on one rank is an error on every rank, never a
hang, and names the rank, call, input, plan entry or collective involved.

Every distributed case runs with a 60 s limit; each job returns the error message every rank saw
(``error_message``), so the tests check that *all* ranks raised, not only the first.
"""

import os
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel import options
from hyper_parallel.testing.distributed import WorkerPool
from hyper_parallel.testing.parity import build_model, build_plan, error_message, global_batch

LIMIT_S = 60


def _model(plan: str, **kwargs):
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("tp" if plan == "tp" else "dp",))
    return hp.parallelize(build_model("llama", num_hidden_layers=2), build_plan(plan), mesh, **kwargs)


# --- one rank's inputs differ from its peers' -----------------------------------------------------

def input_faults(plan: str) -> dict:
    """On one compiled model (compiling is what costs time here), each fault in turn; returns what
    this rank raised for each."""
    model = _model(plan)
    model(**global_batch("llama", 4, 16))["loss"].backward()  # every rank caches this signature
    rank1 = dist.get_rank() == 1
    out = {}
    # Rank 0 hits its cache while rank 1 would compile a new signature.
    out["signature"] = error_message(lambda: model(**global_batch("llama", 4, 8 if rank1 else 16)))
    for name, bad in (("id_high", 256), ("id_negative", -1), ("label", 300)):
        batch = global_batch("llama", 4, 16)
        batch["labels"] = batch["labels"].clone()
        if rank1:
            batch["labels" if name == "label" else "input_ids"][0, 3] = bad
        out[name] = error_message(lambda: model(**batch))
    rows = 0 if rank1 else 2  # rank 1's loader ran dry
    out["empty"] = error_message(lambda: model(**{k: v[:rows] for k, v in global_batch("llama", 2, 16).items()}))
    out["healthy"] = error_message(lambda: model(**global_batch("llama", 4, 16))["loss"].backward())
    return out


@pytest.mark.parametrize("plan", ["dp", "tp"])
def test_input_faults_raise_on_every_rank(dist2, plan):
    """Under tp the vocabulary-parallel embedding would silently give zeros for an out-of-range id;
    under dp only rank 1 would raise and rank 0 would wait in the next collective."""
    start = time.monotonic()
    for out in dist2.run_with_timeout(LIMIT_S, input_faults, plan):
        message = out["signature"]
        assert message.startswith("AgreementError: call 2 of LlamaForCausalLM"), message
        assert "rank 0 has \"input 'input_ids': int64[4, 16] on cpu\"" in message, message
        assert "rank 1 has \"input 'input_ids': int64[4, 8] on cpu\"" in message, message
        for name, bad in (("id_high", 256), ("id_negative", -1)):
            message = out[name]
            assert f"rank 1: input 'input_ids' holds token id {bad}" in message, message
            assert "embedding 'model.embed_tokens'" in message and "[0, 256)" in message, message
        assert "rank 1: input 'labels' holds label 300" in out["label"], out["label"]
        assert "rank 1: input 'input_ids' is empty (shape (0, 16))" in out["empty"], out["empty"]
        assert out["healthy"] == "no error"  # the model is still usable after the errors
    assert time.monotonic() - start < LIMIT_S


def pipeline_signature_fault() -> dict:
    """A pipeline step after the first: rank 0 (stage 0) reuses its programs, so it issues the
    agreement and starts its first micro-batch before waiting (at its first send); rank 1 passes
    another sequence length and waits at once. Both raise the disagreement, then train on."""
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    plan = {"pipeline": hp.PipelinePlan(split_points=["model.layers.1"], schedule="1F1B", num_microbatches=2)}
    model = hp.parallelize(build_model("llama", num_hidden_layers=2), plan, mesh)
    model.step(global_batch("llama", 4, 16))
    rank1 = dist.get_rank() == 1
    out = {"signature": error_message(lambda: model.step(global_batch("llama", 4, 8 if rank1 else 16)))}
    out["healthy"] = error_message(lambda: model.step(global_batch("llama", 4, 16)))
    return out


def test_pipeline_step_disagreement_raises_on_every_rank(dist2):
    start = time.monotonic()
    for out in dist2.run_with_timeout(LIMIT_S, pipeline_signature_fault):
        message = out["signature"]
        assert message.startswith("AgreementError: step 2 of LlamaForCausalLM"), message
        assert "int64[4, 16]" in message and "int64[4, 8]" in message, message
        assert out["healthy"] == "no error"
    assert time.monotonic() - start < LIMIT_S


def out_of_range_ids_unchecked() -> str:
    model = _model("tp", check_inputs=False)
    batch = global_batch("llama", 4, 16)
    batch["labels"] = batch["labels"].clone()
    batch["input_ids"][0, 3] = 300
    return error_message(lambda: model(**batch)["loss"].backward())


def test_check_inputs_false_turns_the_checks_off(dist2):
    # What the check prevents: tensor parallelism runs an out-of-range id without any error.
    assert dist2.run_with_timeout(LIMIT_S, out_of_range_ids_unchecked) == ["no error", "no error"]


# --- plans that differ between ranks ------------------------------------------------------------------

def differing_plans() -> str:
    mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    units = ["model.layers.*", ""] if dist.get_rank() == 0 else ["model.layers.0", ""]
    return error_message(hp.parallelize, build_model("llama", num_hidden_layers=2),
                         {"fully_shard": {"units": units}}, mesh)


def test_differing_plans_raise_before_parameters_are_distributed(dist2):
    for message in dist2.run_with_timeout(LIMIT_S, differing_plans):
        assert message.startswith("AgreementError: parallelize(LlamaForCausalLM): ranks disagree"), message
        # The first differing line: a layer-1 parameter is in its own unit on rank 0 only.
        assert "FSDP unit 'model.layers.1'" in message and "FSDP unit ''" in message, message


# --- a peer that stays alive but does not run the step -------------------------------------------

def stuck_peer_in_backward() -> str:
    model = _model("dp", timeout=3)
    loss = model(**global_batch("llama", 4, 16))["loss"]
    if dist.get_rank() == 1:
        time.sleep(6)  # alive, but never runs this backward
        return "stuck"
    try:
        loss.backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


@pytest.mark.pool
def test_stuck_peer_times_out_naming_program_collective_and_call():
    # Its own pool: the timeout applies to the mesh's groups, here the pool's world group, and the
    # broken connection would outlive the test.
    with WorkerPool(2) as pool:
        start = time.monotonic()
        message, stuck = pool.run_with_timeout(LIMIT_S, stuck_peer_in_backward)
    assert stuck == "stuck"
    assert message.startswith("call 1 of LlamaForCausalLM (rank 0), backward program: waiting for the "
                              "all_reduce over mesh axis 'dp'"), message
    assert "timeout=seconds" in message, message
    assert time.monotonic() - start < LIMIT_S


# --- options ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("option,value,error", [
    ("prefetch_depth", -1, "prefetch_depth=-1): must be >= 0"),
    ("prefetch_depth", 1.5, "prefetch_depth=1.5): give an int"),
    ("reductions_in_flight", -1, "reductions_in_flight=-1): must be >= 0"),
    ("memory_budget_bytes", 0, "the budget must be a positive number of bytes"),
    ("memory_budget_bytes", -5, "the budget must be a positive number of bytes"),
    ("memory_budget_bytes", "1GB", "memory_budget_bytes='1GB'): give the per-rank budget in bytes as an int"),
    ("bucket_cap_mb", 0, "bucket_cap_mb=0): give a positive size"),
    ("timeout", -3, "timeout=-3): the timeout must be positive"),
    ("timeout", "5s", "timeout='5s'): give seconds or a datetime.timedelta"),
    ("check_inputs", "yes", "check_inputs='yes'): give True, False or None"),
])
def test_option_checks(option, value, error):
    # Checked first, before the mesh or the model are looked at.
    with pytest.raises((ValueError, TypeError)) as info:
        hp.parallelize(torch.nn.Linear(2, 2), {}, None, **{option: value})
    assert error in str(info.value), str(info.value)


def test_dump_dir_must_be_writable(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"dump_dir=.*a_file.*cannot write the dump folder"):
        options.prepare_dump_dir(str(blocker), 0, "dump_dir")
    with pytest.raises(ValueError, match=r"HYPER_PARALLEL_DUMP_DIR="):
        options.prepare_dump_dir(str(blocker), 0, "HYPER_PARALLEL_DUMP_DIR")


def test_dump_dir_of_a_running_job_is_refused_and_a_finished_one_replaced(tmp_path):
    import json
    import socket

    folder = tmp_path / "rank0"
    folder.mkdir()
    (folder / "00_captured.py").write_text("from another run")
    live = subprocess.Popen(["sleep", "30"])
    try:
        (folder / options.OWNER_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": live.pid}))
        with pytest.raises(ValueError, match=rf"being written by another running process \(pid {live.pid}\)"):
            options.prepare_dump_dir(str(tmp_path), 0, "dump_dir")
    finally:
        live.kill()
        live.wait()
    # The same owner, now finished: its dump is replaced whole, never mixed with this one.
    options.prepare_dump_dir(str(tmp_path), 0, "dump_dir")
    assert sorted(os.listdir(folder)) == [options.OWNER_FILE]
    assert json.loads((folder / options.OWNER_FILE).read_text())["pid"] == os.getpid()
