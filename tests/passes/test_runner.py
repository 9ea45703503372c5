"""The pass runner (passes/runner.py): rewrites before propagation and passes after lowering run
as one ordered list, each timed into the compile summary and dumped; optional passes are disabled
by name, required rewrites cannot be, and a bad name is a ValueError listing what can be named.
Compiled on one simulated rank (torch's ``fake`` backend) of a 2-rank FSDP mesh, a tiny MLP with a
token-mean loss, so every rewrite has work to do."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import hyper_parallel as hp
from hyper_parallel.tools.explain import compile_for_explain, fake_world
from hyper_parallel.passes import pass_names, rewrite_names
from hyper_parallel.testing.parity import error_message


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 16)

    def forward(self, ids, labels):
        logits = self.proj(self.emb(ids))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


PLAN = {"fully_shard": {"units": ["proj", ""]}}


def _compile(**options):
    with fake_world(2, 0):
        mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        with hp.init_empty_weights():
            model = Net()
        ids = torch.empty(2, 4, dtype=torch.long, device="meta")
        return compile_for_explain(model, PLAN, mesh, (ids, ids), **options)


def test_every_rewrite_and_pass_is_timed_in_the_summary():
    seconds = _compile().compile_summary()["pass_seconds"]
    assert list(seconds) == rewrite_names() + pass_names()
    assert all(isinstance(s, float) and s >= 0 for s in seconds.values()), seconds


def test_rewrites_are_dumped_between_capture_and_lowering(tmp_path):
    _compile(dump_dir=str(tmp_path))
    files = sorted(p.name for p in (tmp_path / "rank0").glob("0[01]*.py"))
    assert files == ["00_captured.py", "00a_causal_mask.py", "00b_loss_reduction.py", "00c_merge_boundaries.py",
                     "00d_fsdp_unshard.py", "00e_gradient_accumulation.py", "01_lowered.py"]
    # The loss rewrite is visible in its dump: the mean (reduction 1) became a sum (2) divided by
    # the token count.
    captured = (tmp_path / "rank0" / "00_captured.py").read_text()
    rewritten = (tmp_path / "rank0" / "00b_loss_reduction.py").read_text()
    assert "None, 1, -100)" in captured and "aten.div.Tensor" not in captured
    assert "None, 2, -100)" in rewritten and "aten.div.Tensor" in rewritten
    assert "hyper_parallel.unshard" in (tmp_path / "rank0" / "00d_fsdp_unshard.py").read_text()
    # Timings are in no dump file: dumps stay byte-identical across compiles.
    assert not any("pass_seconds" in p.read_text() for p in (tmp_path / "rank0").iterdir())


def test_disabled_pass_is_not_run_nor_timed():
    seconds = _compile(disable_passes=("prefetch", "cse")).compile_summary()["pass_seconds"]
    assert "prefetch" not in seconds and "cse" not in seconds and "bucketing" in seconds


@pytest.mark.parametrize("names, expected", [
    (("loss_reduction",), "['loss_reduction'], which single-device numerics depend on"),
    (("fsdp_unshard", "cse"), "cannot be disabled. The passes that can: ['causal_mask', 'cleanup', 'cse'"),
    (("prefetching",), "disable_passes names unknown passes ['prefetching']; the passes are ['causal_mask', 'cleanup'"),
])
def test_bad_disable_passes_name_what_can_be_disabled(names, expected):
    assert expected in error_message(lambda: _compile(disable_passes=names))
