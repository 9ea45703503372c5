"""The ops the swap pass emits: device <-> host copies on a side stream, ordered by events.

``hyper_parallel::swap_out(x) -> host``: copy an activation to host memory. On an accelerator the
copy is issued on the device's swap stream (one per device) after that stream waits for the
current stream, into pinned memory, with ``non_blocking=True``; ``x.record_stream`` keeps its
device memory from being reused until the copy is done. So forward does not wait for the transfer.

``hyper_parallel::swap_in(host, device) -> y``: start the copy back. The result is allocated on the
current stream (its memory is then reused in that stream's order) and filled on the swap stream,
which runs the copies in issue order, so it also follows the ``swap_out`` that filled ``host``. An
event recorded after the copy is kept until ``swap_wait``.

``hyper_parallel::swap_wait(y) -> y``: the current stream waits for ``y``'s copy-back event (the
host does not block). It returns a view of ``y``, so the first backward use reads the value only
after the wait, in graph order and in data order. The swap pass issues ``swap_in`` one group ahead
and ``swap_wait`` right before the first use, so the transfer overlaps the previous group's backward.

On the CPU the three are plain copies (``swap_out``/``swap_in``) and a view (``swap_wait``): the
same graph runs with the same numerics, which is what CPU tests check.
"""

from __future__ import annotations

import torch

_SWAP_STREAMS: dict[torch.device, object] = {}  # device -> its swap stream
_PENDING: dict[int, object] = {}  # data_ptr of a swap_in result -> the event its copy records


def _device_module(device: torch.device):
    return torch.get_device_module(device)


def _swap_stream(device: torch.device):
    stream = _SWAP_STREAMS.get(device)
    if stream is None:
        stream = _SWAP_STREAMS[device] = _device_module(device).Stream(device=device)
    return stream


@torch.library.custom_op("hyper_parallel::swap_out", mutates_args=())
def swap_out(x: torch.Tensor) -> torch.Tensor:
    """A host copy of ``x`` (asynchronous on an accelerator: see the module docstring)."""
    if x.device.type == "cpu":
        return x.clone()
    module = _device_module(x.device)
    stream = _swap_stream(x.device)
    stream.wait_stream(module.current_stream(x.device))
    with module.stream(stream):
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        host.copy_(x, non_blocking=True)
    x.record_stream(stream)
    return host


@swap_out.register_fake
def _swap_out_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


@torch.library.custom_op("hyper_parallel::swap_in", mutates_args=())
def swap_in(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Start copying ``host`` back to ``device``; ``swap_wait`` on the result before reading it."""
    device = torch.device(device)
    if device.type == "cpu":
        return host.clone()
    module = _device_module(device)
    out = torch.empty(host.shape, dtype=host.dtype, device=device)
    if out.numel() == 0:
        return out
    stream = _swap_stream(device)
    stream.wait_stream(module.current_stream(device))  # ``out``'s memory may have been freed there
    with module.stream(stream):
        out.copy_(host, non_blocking=True)
        event = module.Event()
        event.record(stream)
    _PENDING[out.data_ptr()] = event
    return out


@swap_in.register_fake
def _swap_in_fake(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty(host.shape, dtype=host.dtype, device=device)


torch.library.define("hyper_parallel::swap_wait", "(Tensor(a) x) -> Tensor(a)")


@torch.library.impl("hyper_parallel::swap_wait", "CompositeExplicitAutograd")
def swap_wait(x: torch.Tensor) -> torch.Tensor:
    """Make the current stream wait for ``x``'s copy back; a view of ``x``."""
    event = _PENDING.pop(x.data_ptr(), None)
    if event is not None:
        _device_module(x.device).current_stream(x.device).wait_event(event)
    return x.view(x.shape)


@torch.library.register_fake("hyper_parallel::swap_wait")
def _swap_wait_fake(x: torch.Tensor) -> torch.Tensor:
    return x.view(x.shape)


SWAP_OUT = torch.ops.hyper_parallel.swap_out.default
SWAP_IN = torch.ops.hyper_parallel.swap_in.default
SWAP_WAIT = torch.ops.hyper_parallel.swap_wait.default


def pending_copies() -> int:
    """Copies back issued and not yet waited on (0 after every complete backward)."""
    return len(_PENDING)
