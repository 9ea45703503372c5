"""The progress lines' default visibility (``HYPER_PARALLEL_LOG``), in a fresh interpreter: a
handler at INFO on the ``hyper_parallel`` logger unless the application configured logging or the
environment asks for quiet; a bad value is refused naming the choices. (The lines themselves:
tests/distributed/test_progress_and_recompiles.py.)"""

import os
import subprocess
import sys

PROBE = """
import logging, sys
from hyper_parallel.progress import Progress, enable_default_logging
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.WARNING)
enable_default_logging()
p = Progress("compile Model")
with p.phase("capture"):
    pass
p.done("3 collectives per step")
"""


def _run(mode: str, value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYPER_PARALLEL_LOG"}
    if value is not None:
        env["HYPER_PARALLEL_LOG"] = value
    return subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=120)


def test_default_handler_and_its_switch():
    shown = _run("plain", None)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stderr.splitlines()
    assert lines[0].startswith("[hyper_parallel] compile Model: capture 0.") and lines[0].endswith(" s"), lines
    assert lines[1].startswith("[hyper_parallel] compile Model: done in ") and "3 collectives per step" in lines[1]
    assert _run("plain", "quiet").stderr == ""
    assert _run("configured", None).stderr == ""  # the application's WARNING configuration decides
    bad = _run("plain", "loud")
    assert bad.returncode != 0 and "HYPER_PARALLEL_LOG='loud': choose one of" in bad.stderr
