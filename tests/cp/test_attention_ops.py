"""The SDPA kernel families' block interface (cp/attention_ops.py) against whole-sequence attention.

Ring attention merges blocks by the log-sum-exp each family's ``block_forward`` returns and feeds
the merged one to ``block_backward``; here every family, on CPU (the GPU families through their
emulation, hyper_parallel/testing/emulated_attention.py), computes a sequence in two chunks as ring
attention on two ranks would and must match the math kernel on the whole sequence. tests/gpu runs
the same check on the real GPU kernels.
"""

import pytest
import torch

from hyper_parallel.testing.attention_blocks import blockwise_errors
from hyper_parallel.testing.emulated_attention import register_cpu_emulation

CASES = [("cpu_flash", False), ("cpu_flash", True), ("flash", False), ("efficient", False), ("efficient", True),
         ("cudnn", False), ("cudnn", True)]


@pytest.mark.parametrize("family,masked", CASES)
def test_blocks_merge_to_the_whole_sequence(family, masked):
    register_cpu_emulation()
    errors = blockwise_errors(family, "cpu", torch.float32, masked)
    assert max(errors.values()) < 1e-4, errors


def test_a_wrong_merge_is_caught():
    """The check can fail: the efficient kernel's padded log-sum-exp read as if it were not
    trimmed gives the wrong block weights."""
    from hyper_parallel.cp import attention_ops

    register_cpu_emulation()
    trim = attention_ops.CudaEfficient.lse_tokens
    try:
        attention_ops.CudaEfficient.lse_tokens = lambda self, lse, length: lse.narrow(-1, lse.shape[-1] - length, length)
        errors = blockwise_errors("efficient", "cpu", torch.float32, False)
    finally:
        attention_ops.CudaEfficient.lse_tokens = trim
    assert max(errors.values()) > 1e-2, errors
