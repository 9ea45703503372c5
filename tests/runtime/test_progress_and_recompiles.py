"""What a user sees during long work and when programs multiply: the progress lines of a compile
(rank 0, one per phase with its seconds, in order), the recompile line naming what changed, the
warning past ``recompile_limit`` and the error with ``fail_on_recompile_limit=True``."""

import logging
import re

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.testing.parity import build_model, global_batch, local_batch


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, str]] = []

    def emit(self, record):
        self.records.append((record.levelname, record.getMessage()))


def _compile_three_lengths(fail: bool) -> dict:
    """Two ranks of data parallelism; sequence lengths 16, 16, 32, 24 with recompile_limit=2."""
    package = logging.getLogger("hyper_parallel")
    package.setLevel(logging.INFO)  # the pool's workers run with HYPER_PARALLEL_LOG=quiet
    handler = _Records()
    package.addHandler(handler)
    try:
        mesh = hp.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        model = hp.parallelize(build_model("llama", num_hidden_layers=1), {}, mesh, recompile_limit=2,
                               fail_on_recompile_limit=fail)
        error = None
        for seq in (16, 16, 32, 24):
            try:
                model(**local_batch(global_batch("llama", 4, seq), mesh))["loss"].backward()
            except ValueError as exc:
                error = str(exc)
                break
        return {"records": handler.records, "error": error}
    finally:
        package.removeHandler(handler)
        package.setLevel(logging.WARNING)


def test_progress_lines_and_recompiles(dist2):
    rank0, rank1 = dist2.run(_compile_three_lengths, False)
    assert rank1["records"] == []  # progress and recompiles: rank 0 only
    messages = [m for _, m in rank0["records"]]
    first = messages[:messages.index(next(m for m in messages if "done in" in m)) + 1]
    phases = [re.match(r"compile LlamaForCausalLM: (.+?) [\d.]+ s", m).group(1) for m in first[:-1]]
    assert phases == ["capture", "propagation", "lowering", "passes", "partition", "SPMD check"], first
    assert re.search(r"passes [\d.]+ s \(.*bucketing [\d.]+", first[3]), first[3]  # each pass's seconds
    assert re.fullmatch(r"compile LlamaForCausalLM: done in [\d.]+ s; \d+ collectives per step", first[-1])
    recompiles = [m for m in messages if m.startswith("recompiling")]
    assert recompiles == [
        "recompiling LlamaForCausalLM (program 2): input 'input_ids': int64[2, 16] on cpu -> int64[2, 32] on cpu; "
        "input 'labels': int64[2, 16] on cpu -> int64[2, 32] on cpu",
        "recompiling LlamaForCausalLM (program 3): input 'input_ids': int64[2, 32] on cpu -> int64[2, 24] on cpu; "
        "input 'labels': int64[2, 32] on cpu -> int64[2, 24] on cpu",
    ], recompiles
    warnings = [m for level, m in rank0["records"] if level == "WARNING"]
    assert len(warnings) == 1 and "compiled 3 programs, past recompile_limit=2" in warnings[0], warnings
    assert sum("done in" in m for m in messages) == 3  # the repeated length reused its program


def test_fail_on_recompile_limit(dist2):
    results = dist2.run(_compile_three_lengths, True)
    for result in results:  # every rank alike, before compiling
        assert result["error"].startswith("LlamaForCausalLM would compile program 3, past "
                                          "parallelize(recompile_limit=2); this one because input "
                                          "'input_ids': int64[2, 32] on cpu -> int64[2, 24] on cpu"), result["error"]
    assert sum("done in" in m for _, m in results[0]["records"]) == 2


def test_recompile_limit_is_checked():
    with pytest.raises(ValueError, match=r"parallelize\(recompile_limit=0\): must be >= 1"):
        hp.parallelize(torch.nn.Linear(2, 2), {}, object(), recompile_limit=0)
