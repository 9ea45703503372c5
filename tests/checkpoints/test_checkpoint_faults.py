"""Faults of hp.save_checkpoint / hp.load_checkpoint (hyper_parallel/checkpoints/io.py).

A checkpoint must survive a save killed at any step (the previous one stays loadable at ``path``,
the half-written one is rejected), and a load must refuse, on every rank and with the file or key
named, anything that is not exactly what was saved: a changed byte, a missing or truncated file, no
manifest, a model with other keys. DCP's own errors (a BaseException) must arrive as an Exception.

Kills are simulated at each step of a save through the module's private ``_fault_hook``: in this
process by raising a BaseException (which the save's cleanup, ``except Exception``, lets through as
a kill would), on 2 gloo ranks at once, and once for real with SIGKILL in a subprocess.
"""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.checkpoints import io as checkpoint_io
from hyper_parallel.models import llama_tp_plan, mlp_tp_plan
from hyper_parallel.testing.parity import build_model, global_batch, local_batch

LLAMA = {"num_key_value_heads": 4}  # kv heads divisible by tp=2
JOB_TIMEOUT_S = 60  # a job that hangs (a rank waiting for one that raised) fails fast


class _Killed(BaseException):
    """A simulated kill: not an Exception, so no cleanup code of the save handles it."""


def _kill_at(step):
    def hook(reached):
        if reached == step:
            raise _Killed(step)
    return hook


def _equal_states(model, reference, what):
    full = hp.get_model_state_dict(model, hp.StateDictOptions(full_state_dict=True))
    assert full.keys() == reference.keys(), what
    for key, value in full.items():
        torch.testing.assert_close(value, reference[key], rtol=0, atol=0, msg=lambda m, k=key: f"{what}: {k}: {m}")


def _siblings(path):
    parent, base = os.path.dirname(path), os.path.basename(path)
    return sorted(n for n in os.listdir(parent) if n.startswith(base + ".tmp-") or n.startswith(base + ".old-"))


# --------------------------------------------------------------------------------------------
# One process (no process group): every step of an interrupted overwrite, and a real SIGKILL
# --------------------------------------------------------------------------------------------

# step killed at -> which checkpoint path holds afterwards
KILL_STEPS = {"data_written": "old", "manifest_written": "old", "old_moved": "new", "new_moved": "new"}


@pytest.mark.parametrize("step", sorted(KILL_STEPS))
def test_overwrite_killed_at_any_step_leaves_a_loadable_checkpoint(tmp_path, monkeypatch, step):
    path = str(tmp_path / "ckpt")
    old, new = build_model("mlp", seed=1), build_model("mlp", seed=2)
    hp.save_checkpoint(path, old)
    monkeypatch.setattr(checkpoint_io, "_fault_hook", _kill_at(step))
    with pytest.raises(_Killed):
        hp.save_checkpoint(path, new)
    monkeypatch.setattr(checkpoint_io, "_fault_hook", None)

    expected = {"old": old, "new": new}[KILL_STEPS[step]].state_dict()
    target = build_model("mlp", seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert hp.load_checkpoint(path, target) == ([], [])
    _equal_states(target, expected, f"killed at {step}")
    recovered = [str(w.message) for w in caught if "interrupted" in str(w.message)]
    assert bool(recovered) == (step == "old_moved"), recovered  # only then is path itself absent
    if step == "old_moved":
        assert not os.path.exists(path) and ".tmp-" in recovered[0]

    if step == "data_written":  # the half-written directory is rejected when pointed at
        (partial,) = _siblings(path)
        with pytest.raises(hp.CheckpointError, match=r"incomplete checkpoint: .*\.tmp-.* was not finished "
                           r"\(no hp_checkpoint\.json\)"):
            hp.load_checkpoint(os.path.join(tmp_path, partial), target)

    # The next save completes and removes what the interrupted one left.
    hp.save_checkpoint(path, new)
    assert _siblings(path) == [] and sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "hp_checkpoint.json"]
    hp.load_checkpoint(path, target)
    _equal_states(target, new.state_dict(), "after the next save")


KILLED_SAVE = """
import os, signal, sys
import hyper_parallel as hp
from hyper_parallel.checkpoints import io as checkpoint_io
from hyper_parallel.testing.parity import build_model

path = sys.argv[1]
hp.save_checkpoint(path, build_model("mlp", seed=1))
def kill(step):
    if step == "data_written":
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint_io._fault_hook = kill
hp.save_checkpoint(path, build_model("mlp", seed=2))
"""


@pytest.mark.slow
def test_sigkill_after_data_before_manifest_keeps_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "ckpt")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_SAVE), path], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    (partial,) = _siblings(path)  # the killed save's data, without a manifest
    assert "__0_0.distcp" in os.listdir(tmp_path / partial)
    assert "hp_checkpoint.json" not in os.listdir(tmp_path / partial)
    target = build_model("mlp", seed=3)
    hp.load_checkpoint(path, target)
    _equal_states(target, build_model("mlp", seed=1).state_dict(), "after SIGKILL")
    with pytest.raises(hp.CheckpointError, match="no hp_checkpoint.json"):
        hp.load_checkpoint(str(tmp_path / partial), target)


def test_save_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(hp.CheckpointError, match=r"is not a checkpoint \(it holds \['notes.txt'\]\)"):
        hp.save_checkpoint(str(tmp_path), build_model("mlp"))
    assert os.listdir(tmp_path) == ["notes.txt"]


# --------------------------------------------------------------------------------------------
# 2 ranks: damaged files, an interrupted save, other keys; every error raised on both ranks
# --------------------------------------------------------------------------------------------


def _parallel(seed=0, layers=2):
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = hp.parallelize(build_model("llama", seed=seed, num_hidden_layers=layers, **LLAMA), llama_tp_plan(), mesh)
    return model, mesh


def _reference(seed=0, layers=2):
    return build_model("llama", seed=seed, num_hidden_layers=layers, **LLAMA).state_dict()


def save_job(path, seed, layers=2):
    model, _ = _parallel(seed, layers)
    hp.save_checkpoint(path, model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return sorted(os.listdir(path))


def _expect_error(fn):
    """The error this rank raised: it must be an Exception (not only a BaseException)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 -- the type is asserted by the caller
        return type(exc).__name__, isinstance(exc, ValueError), str(exc)
    raise AssertionError("no error raised")


def damaged_loads_job(paths):
    model, _ = _parallel(seed=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = hp.get_model_state_dict(model, hp.StateDictOptions(full_state_dict=True))
    errors = {case: _expect_error(lambda: hp.load_checkpoint(path, model, opt)) for case, path in paths.items()}
    _equal_states(model, before, "after rejected loads")  # rejected before DCP read anything
    return errors


def _damage(source, target, name, how):
    shutil.copytree(source, target)
    file = os.path.join(target, name)
    size = os.path.getsize(file)
    if how == "flip":  # one byte in the middle of the tensor data
        with open(file, "r+b") as f:
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif how == "zero":  # same size, unreadable records: only DCP notices (verify=False)
        with open(file, "r+b") as f:
            f.write(bytes(size))
    elif how == "truncate":
        os.truncate(file, size // 2)
    elif how == "delete":
        os.remove(file)
    return target


def test_damaged_checkpoints_raise_naming_the_file_on_every_rank(dist2, tmp_path):
    good = str(tmp_path / "good")
    assert dist2.run_with_timeout(JOB_TIMEOUT_S, save_job, good, 1)[0] == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "hp_checkpoint.json"]
    paths = {
        "flipped": _damage(good, str(tmp_path / "flipped"), "__1_0.distcp", "flip"),  # checked by rank 1
        "missing": _damage(good, str(tmp_path / "missing"), "__0_0.distcp", "delete"),
        "truncated": _damage(good, str(tmp_path / "truncated"), "__1_0.distcp", "truncate"),
        "no_manifest": _damage(good, str(tmp_path / "no_manifest"), "hp_checkpoint.json", "delete"),
        "metadata": _damage(good, str(tmp_path / "metadata"), ".metadata", "flip"),
    }
    size = os.path.getsize(os.path.join(good, "__1_0.distcp"))
    per_rank = dist2.run_with_timeout(JOB_TIMEOUT_S, damaged_loads_job, paths)
    for rank, errors in enumerate(per_rank):  # both ranks returned: none hung
        for case, (kind, is_value_error, message) in errors.items():
            assert kind == "CheckpointError" and is_value_error, (rank, case, kind, message)
        assert "__1_0.distcp has CRC-32" in errors["flipped"][2] and "contents changed" in errors["flipped"][2]
        assert str(tmp_path / "flipped") in errors["flipped"][2]
        assert "__0_0.distcp is missing" in errors["missing"][2]
        assert f"__1_0.distcp has {size // 2} bytes, expected {size}" in errors["truncated"][2]
        assert (f"incomplete checkpoint: {tmp_path / 'no_manifest'} was not finished (no hp_checkpoint.json)"
                in errors["no_manifest"][2])
        assert ".metadata has CRC-32" in errors["metadata"][2]
    # A file checked by one rank only is reported by the other one too, with the rank named.
    assert per_rank[0]["flipped"][2].startswith("rank 1: ")


def dcp_error_job(path):
    model, _ = _parallel(seed=5)
    return _expect_error(lambda: hp.load_checkpoint(path, model, verify=False))


def test_dcp_errors_become_exceptions_naming_the_checkpoint(dist2, tmp_path):
    good = str(tmp_path / "good")
    dist2.run_with_timeout(JOB_TIMEOUT_S, save_job, good, 1)
    for name in ("__0_0.distcp", "__1_0.distcp"):  # same sizes, unreadable records: only DCP notices
        path = _damage(good, str(tmp_path / f"bad{name}"), name, "zero")
        for rank, (kind, is_value_error, message) in enumerate(dist2.run_with_timeout(JOB_TIMEOUT_S, dcp_error_job, path)):
            assert kind == "CheckpointError" and is_value_error, (rank, message)
            assert f"load of checkpoint {path} failed in torch.distributed.checkpoint on rank(s)" in message
            assert f"reading {name}: UnpicklingError" in message
            assert "verify=True checks every file" in message


def killed_save_job(path):
    """Save seed 1, then a save of seed 2 killed on both ranks after its data, before the manifest."""
    model, _ = _parallel(seed=1)
    hp.save_checkpoint(path, model)
    model, _ = _parallel(seed=2)
    checkpoint_io._fault_hook = _kill_at("data_written")
    try:
        hp.save_checkpoint(path, model)
        raise AssertionError("the save was not interrupted")
    except _Killed:
        pass
    finally:
        checkpoint_io._fault_hook = None
    model, _ = _parallel(seed=3)
    hp.load_checkpoint(path, model)
    _equal_states(model, _reference(seed=1), "previous checkpoint")
    (partial,) = _siblings(path)
    return _expect_error(lambda: hp.load_checkpoint(os.path.join(os.path.dirname(path), partial), model))


def test_save_killed_on_two_ranks_keeps_the_previous_checkpoint(dist2, tmp_path):
    for kind, _, message in dist2.run_with_timeout(JOB_TIMEOUT_S, killed_save_job, str(tmp_path / "ckpt")):
        assert kind == "CheckpointError" and "was not finished (no hp_checkpoint.json)" in message


def other_keys_job(path4, path2):
    """A 4-layer checkpoint into a 2-layer model and a 2-layer checkpoint into a 4-layer model."""
    small, _ = _parallel(seed=7, layers=2)
    kind, _, unexpected_message = _expect_error(lambda: hp.load_checkpoint(path4, small))
    assert kind == "CheckpointError"
    result = hp.load_checkpoint(path4, small, strict=False)
    assert result.missing_keys == []
    assert result.unexpected_keys and all(k.startswith(("model.layers.2.", "model.layers.3.")) for k in result.unexpected_keys)
    saved = _reference(seed=1, layers=4)
    _equal_states(small, {k: saved[k] for k in _reference(layers=2)}, "strict=False, 4 -> 2 layers")

    large, _ = _parallel(seed=7, layers=4)
    opt = torch.optim.SGD(large.parameters(), lr=0.1, momentum=0.9)
    _, _, missing_message = _expect_error(lambda: hp.load_checkpoint(path2, large, opt))
    result = hp.load_checkpoint(path2, large, opt, strict=False)
    assert result.unexpected_keys == [] and result.missing_keys == sorted(
        k for k in _reference(layers=4) if k.startswith(("model.layers.2.", "model.layers.3.")))
    expected = {**_reference(seed=7, layers=4), **_reference(seed=2, layers=2)}
    _equal_states(large, expected, "strict=False, 2 -> 4 layers (layers 2, 3 keep their values)")
    return unexpected_message, missing_message, len(result.missing_keys)


def test_checkpoint_of_other_keys_raises_unless_strict_false(dist2, tmp_path):
    path4, path2 = str(tmp_path / "four"), str(tmp_path / "two")
    dist2.run_with_timeout(JOB_TIMEOUT_S, save_job, path4, 1, 4)
    dist2.run_with_timeout(JOB_TIMEOUT_S, save_job, path2, 2, 2)
    for unexpected, missing, n_missing in dist2.run_with_timeout(JOB_TIMEOUT_S, other_keys_job, path4, path2):
        assert "unexpected keys (in the checkpoint, not in the model): ['model.layers.2.input_layernorm.weight'" in unexpected
        assert "missing keys" not in unexpected and "strict=False" in unexpected
        assert "missing keys (in the model, not in the checkpoint): ['model.layers.2.input_layernorm.weight'" in missing
        assert n_missing == 18 and "'model.layers.3.self_attn.v_proj.weight']" in missing  # all 18 named
        assert "unexpected keys" not in missing


# --------------------------------------------------------------------------------------------
# Round trip: losses after resume equal an uninterrupted run's (another plan on resume)
# --------------------------------------------------------------------------------------------

STEPS_BEFORE, STEPS_AFTER, BATCH = 2, 2, 8


def _train(model, opt, steps, mesh=None):
    losses = []
    for step in steps:
        batch = global_batch("mlp", BATCH, 0, seed=step + 1)
        loss = model(**(local_batch(batch, mesh) if mesh is not None else batch))  # the MLP returns its loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def train_and_save_job(path):
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = hp.parallelize(build_model("mlp", seed=0), mlp_tp_plan(), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hp.save_checkpoint(path, model, opt)  # replaced by the save below: the overwrite path
    losses = _train(model, opt, range(STEPS_BEFORE), mesh)
    hp.save_checkpoint(path, model, opt)
    return losses


def resume_dp_job(path):
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    model = hp.parallelize(build_model("mlp", seed=9), {}, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)  # both restored from the checkpoint
    assert hp.load_checkpoint(path, model, opt) == ([], [])
    assert opt.param_groups[0]["lr"] == 0.1 and opt.param_groups[0]["momentum"] == 0.9
    return _train(model, opt, range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER), mesh)


def test_round_trip_resumes_exactly_with_another_plan(dist2, tmp_path):
    """Saved under tensor parallelism (twice: the second save replaces the first), resumed under
    data parallelism: the losses continue those of an uninterrupted single-device run."""
    path = str(tmp_path / "ckpt")
    before = dist2.run_with_timeout(JOB_TIMEOUT_S, train_and_save_job, path)[0]
    after = dist2.run_with_timeout(JOB_TIMEOUT_S, resume_dp_job, path)[0]
    assert _siblings(path) == []
    reference = build_model("mlp", seed=0)
    uninterrupted = _train(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9),
                           range(STEPS_BEFORE + STEPS_AFTER))
    torch.testing.assert_close(torch.cat([before, after]), uninterrupted)


def test_single_process_round_trip_with_optimizer(tmp_path):
    path = str(tmp_path / "ckpt")
    model = build_model("mlp", seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    batch = global_batch("mlp", 4, 0)
    model(**batch).backward()  # the MLP returns its loss
    opt.step()
    hp.save_checkpoint(path + "/", model, opt)  # a trailing separator names the same checkpoint
    fresh = build_model("mlp", seed=2)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    hp.load_checkpoint(path, fresh, fresh_opt)
    _equal_states(fresh, model.state_dict(), "single process")
    for p, q in zip(model.parameters(), fresh.parameters()):
        for name in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(fresh_opt.state[q][name], opt.state[p][name], rtol=0, atol=0)
    with pytest.raises(hp.CheckpointError, match="saved with another optimizer"):
        hp.load_checkpoint(path, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(hp.CheckpointError, match=r"no checkpoint at .*elsewhere$"):
        hp.load_checkpoint(str(tmp_path / "elsewhere"), fresh)
