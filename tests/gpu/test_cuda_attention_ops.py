"""The GPU SDPA kernel families' block interface (cp/attention_ops.py) on the real kernels.

CI checks it on CPU through emulated kernels (tests/cp/test_attention_ops.py); the real kernels
decide what the emulation can only mirror: the efficient kernel's padded log-sum-exp, cuDNN's
``[B, H, S, 1]`` one, flash's arguments and RNG state, their mask alignment. Each family computes a
sequence in two chunks as ring attention on two ranks would and must match the math kernel on the
whole sequence (bf16 inputs, fp32 reference).
"""

import pytest
import torch

from hyper_parallel.testing.attention_blocks import blockwise_errors


@pytest.mark.parametrize("family,masked", [("flash", False), ("efficient", False), ("efficient", True),
                                           ("cudnn", False)])
def test_blocks_merge_to_the_whole_sequence_on_the_gpu(family, masked):
    try:
        errors = blockwise_errors(family, "cuda", torch.bfloat16, masked)
    except RuntimeError as exc:  # a kernel this GPU or build does not have (cuDNN attention)
        if "not supported" in str(exc).lower() or "no available kernel" in str(exc).lower():
            pytest.skip(f"{family} attention is not available here: {exc}")
        raise
    assert max(errors.values()) < 5e-2, errors
