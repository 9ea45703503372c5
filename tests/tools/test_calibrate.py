"""``hyper-parallel calibrate`` end to end (``--quick``: 2 gloo processes, about 10 s): it writes a
profile that ``explain --hardware FILE`` loads, with every measured field in a plausible range for
a CPU host."""

import pytest

from hyper_parallel.cost import get_profile
from hyper_parallel.tools.cli import main

pytestmark = pytest.mark.pool  # it spawns its own processes


def test_calibrate_quick_writes_a_loadable_profile(tmp_path, capsys):
    path = str(tmp_path / "here.json")
    assert main(["calibrate", "--quick", "--out", path, "--name", "here"]) == 0
    assert f"profile: {path}" in capsys.readouterr().out
    profile = get_profile(path)
    assert profile.name == "here" and profile.devices_per_node == 2 and profile.host_cores >= 1
    assert 1e9 < profile.peak_flops["fp32"] < 1e13  # 1 GFLOP/s .. 10 TFLOP/s on one core
    assert 1e8 < profile.hbm_bandwidth < 1e12
    assert 0 < profile.op_overhead_s < 1e-3 and 0 <= profile.program_overhead_s < 1e-1
    assert 0 < profile.intra_node_bandwidth and 0 <= profile.intra_node_latency < 1e-1
    assert 0 < profile.host_message_latency_s < 1e-1
    with pytest.raises(SystemExit):
        main(["calibrate", "--out", path, "--ranks", "1"])
