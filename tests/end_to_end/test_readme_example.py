"""README's Example is a complete script: extracted from README.md as written (the first python
block under "## Example"), run with torchrun on 2 gloo ranks, its printed losses equal the one-device
losses it prints next to them, and it ends with the collectives summary."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _example_script() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Example\n"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.pool  # torchrun, 2 processes
def test_readme_example_trains_at_one_device_parity(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_example_script())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYPER_PARALLEL_LOG": "quiet"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    steps = re.findall(r"step (\d)  loss ([\d.]+)  one device ([\d.]+)", run.stdout)
    assert [s for s, _, _ in steps] == ["0", "1", "2"], run.stdout
    for _, loss, reference in steps:
        assert abs(float(loss) - float(reference)) <= 2e-5 * float(reference), steps
    assert float(steps[2][1]) < float(steps[0][1])  # it trains
    assert "'all_reduce': {'tp'" in run.stdout, run.stdout
