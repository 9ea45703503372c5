"""What a placeholder or an output slot of a joint graph is: ``InputInfo.kind`` / ``OutputInfo.kind``.

The kinds are string enums, so a kind compares equal to its value (``InputKind.PARAM == "param"``)
and prints as it. Capture (compile/capture.py) gives the first ones; later stages add their own: FSDP's
pre-gathered parameters and kept gathers (propagation/unshard.py), gradient accumulation
(propagation/accumulation.py), the pipeline split's sends, receives and token counts
(passes/pipeline_split.py).
"""

from __future__ import annotations

import enum


class InputKind(enum.StrEnum):
    PARAM = "param"
    BUFFER = "buffer"
    INPUT = "input"  # a user input, by its flat index and path ("input_ids")
    TANGENT = "tangent"  # the gradient seeding backward for one output
    PREGATHERED = "pregathered"  # an FSDP parameter the user gathered ahead (unshard())
    GRAD_ACCUM = "grad_accum"  # gradients pending from earlier micro-steps (no_sync)
    RECV_FWD = "recv_fwd"  # pipeline: an activation received from the previous stage
    RECV_BWD = "recv_bwd"  # pipeline: a gradient received from the next stage


class OutputKind(enum.StrEnum):
    OUTPUT = "output"  # a user output, by its flat index and path ("loss")
    BUFFER_UPDATE = "buffer_update"  # the new value of a buffer updated in forward (BatchNorm)
    GRAD = "grad"  # a parameter's gradient
    INPUT_GRAD = "input_grad"  # the gradient of a user input that requires grad
    NONE = "none"  # no value (a gradient that is None)
    GATHERED = "gathered"  # an FSDP parameter kept gathered after backward
    SEND_FWD = "send_fwd"  # pipeline: an activation sent to the next stage
    SEND_BWD = "send_bwd"  # pipeline: a gradient sent to the previous stage
    LOSS_COUNT = "loss_count"  # pipeline: the tokens the micro-batch's loss is averaged over
