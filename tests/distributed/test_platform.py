"""``hyper_parallel.distributed.platform.get_platform``: what it reports on this machine (checked against torch
and /proc/meminfo read here), its errors, and that ``torch_npu`` is imported only when NPU is asked
for or found installed (a stand-in ``torch_npu`` package on ``sys.path`` shows when it would be)."""

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hyper_parallel.distributed import platform as hp_platform
from hyper_parallel.distributed.platform import Platform, get_platform

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ACCELERATOR = torch.accelerator.current_accelerator(check_available=True)
needs_cpu_only = pytest.mark.skipif(_ACCELERATOR is not None, reason="an accelerator is present")


def _fake_torch_npu(tmp_path, body: str) -> str:
    """A ``torch_npu`` package whose import runs ``body``; returns the folder to put on sys.path."""
    pkg = tmp_path / "fake" / "torch_npu"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(body))
    return str(tmp_path / "fake")


@pytest.fixture
def no_torch_npu_after():
    yield
    sys.modules.pop("torch_npu", None)


def _meminfo_bytes(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"{field} missing from /proc/meminfo")


def test_platform_matches_torch():
    p = get_platform()
    assert isinstance(p, Platform)
    assert p.torch_version == torch.__version__
    if _ACCELERATOR is None:
        assert (p.device_type, p.backend, p.device_count) == ("cpu", "gloo", 0)
        assert not p.is_accelerator
        assert p.current_device() == torch.device("cpu") == p.device(3) == p.set_device(1)
        p.synchronize()  # no-ops on CPU
        p.empty_cache()
    else:
        assert p.device_type == _ACCELERATOR.type
        assert p.device_count == torch.accelerator.device_count() >= 1
        assert p.backend == {"cuda": "nccl", "npu": "hccl"}.get(p.device_type, p.backend)
        assert p.device(p.device_count + 1) == torch.device(p.device_type, 1 % p.device_count)
    assert get_platform() == p  # a value: asking again describes the same platform
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.device_type = "cuda"


@needs_cpu_only
@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="no /proc/meminfo")
def test_cpu_memory_is_the_hosts():
    p = get_platform("cpu")
    free, total = p.memory_info()
    assert total == p.total_memory
    if "psutil" not in sys.modules:  # psutil is not a dependency; without it /proc/meminfo is read
        assert total == _meminfo_bytes("MemTotal")
    assert 0 < free <= total and 0 < p.free_memory <= total


def test_cpu_memory_unknown_is_none(monkeypatch):
    def no_proc(*args, **kwargs):
        raise FileNotFoundError("/proc/meminfo")

    monkeypatch.setitem(sys.modules, "psutil", None)  # `import psutil` raises ImportError
    monkeypatch.setattr(hp_platform, "open", no_proc, raising=False)
    p = get_platform("cpu")
    assert p.memory_info() is None and p.free_memory is None and p.total_memory is None


def test_device_errors():
    with pytest.raises(TypeError, match="device_type must be a string"):
        get_platform(0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"'cuda' is not available.*get_platform\(\)"):
            get_platform("cuda")
    with pytest.raises(TypeError, match="local_rank must be a non-negative int"):
        Platform("cuda", "nccl", 2, torch.__version__).device(-1)


def test_npu_asked_for_imports_torch_npu(tmp_path, monkeypatch, no_torch_npu_after):
    if "torch_npu" in sys.modules:
        pytest.skip("torch_npu is already loaded")
    path = _fake_torch_npu(tmp_path, 'raise OSError("libascendcl.so: cannot open shared object")')
    monkeypatch.syspath_prepend(path)
    with pytest.raises(ImportError, match=r"torch_npu.*Ascend.*libascendcl"):
        get_platform("npu")


@needs_cpu_only
def test_cpu_asked_for_never_imports_torch_npu(tmp_path, monkeypatch, no_torch_npu_after):
    monkeypatch.syspath_prepend(_fake_torch_npu(tmp_path, "LOADED = True\n"))
    assert get_platform("cpu").device_type == "cpu"
    assert "torch_npu" not in sys.modules
    # Detection does import an installed torch_npu (this stand-in registers no device: CPU).
    assert get_platform().device_type == "cpu"
    assert sys.modules["torch_npu"].LOADED


@needs_cpu_only
def test_broken_torch_npu_warns_and_falls_back(tmp_path, monkeypatch, no_torch_npu_after):
    monkeypatch.syspath_prepend(_fake_torch_npu(tmp_path, 'raise RuntimeError("no CANN")\n'))
    with pytest.warns(UserWarning, match="no CANN.*falls back to the CPU"):
        assert get_platform().device_type == "cpu"


@pytest.mark.slow
def test_importing_the_package_does_not_import_torch_npu(tmp_path):
    fake = _fake_torch_npu(tmp_path, "LOADED = True\n")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import hyper_parallel, hyper_parallel.distributed.platform, hyper_parallel.distributed.process_group;"
        "print('torch_npu' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, fake], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
