"""The progress lines' default visibility (``HYPER_PARALLEL_LOG``), in a fresh interpreter: a
handler at INFO on the ``hyper_parallel`` logger unless the application configured logging or the
environment asks for quiet; a bad value is refused naming the choices. (The lines themselves:
tests/runtime/test_progress_and_recompiles.py.)"""

import os
import subprocess
import sys

import pytest

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


def _start(mode: str, value: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "HYPER_PARALLEL_LOG"}
    if value is not None:
        env["HYPER_PARALLEL_LOG"] = value
    return subprocess.Popen([sys.executable, "-c", PROBE, mode], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(probe: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = probe.communicate(timeout=120)
    return subprocess.CompletedProcess(probe.args, probe.returncode, out, err)


@pytest.mark.slow
def test_default_handler_and_its_switch():
    # The four interpreters start at once: each spends its seconds importing torch.
    probes = [_start("plain", None), _start("plain", "quiet"), _start("configured", None), _start("plain", "loud"),
              _start("plain", "")]
    try:
        shown, quiet, configured, bad, empty = [_finish(p) for p in probes]
    finally:
        for probe in probes:
            probe.kill()  # no-op for those that ended; none is left behind by a timeout
    assert shown.returncode == 0, shown.stderr
    lines = shown.stderr.splitlines()
    assert lines[0].startswith("[hyper_parallel] compile Model: capture 0.") and lines[0].endswith(" s"), lines
    assert lines[1].startswith("[hyper_parallel] compile Model: done in ") and "3 collectives per step" in lines[1]
    assert quiet.stderr == ""
    assert configured.stderr == ""  # the application's WARNING configuration decides
    assert bad.returncode != 0 and "HYPER_PARALLEL_LOG='loud': choose one of" in bad.stderr
    # Set but empty (``HYPER_PARALLEL_LOG= cmd``, a shell's way to clear it): the default.
    assert empty.returncode == 0 and empty.stderr.startswith("[hyper_parallel] compile Model: capture "), empty.stderr
