"""The profiler: record_function ranges as graph nodes, whether a profiler is recording, and the
allocator events a memory profile recorded.

Private names: the profiler's own ``_record_function_enter_new`` / ``_record_function_exit`` ops
(runtime/profiled.py puts them in a program's graph), ``torch.autograd.profiler._is_profiler_enabled``,
and ``torch._C._profiler._EventType`` with the Kineto event tree (testing/memory_tracker.py reads
every allocation from it, including memory no dispatcher op returns).
"""

from __future__ import annotations

import torch

__all__ = ["RECORD_FUNCTION_ENTER", "RECORD_FUNCTION_EXIT", "allocation_events", "profiler_enabled"]

# record_function's own enter/exit ops, as graph nodes (runtime/profiled.py): the handle enter returns
# is what exit takes.
RECORD_FUNCTION_ENTER = torch.ops.profiler._record_function_enter_new.default
RECORD_FUNCTION_EXIT = torch.ops.profiler._record_function_exit._RecordFunction


def allocation_events(prof) -> list[tuple[int, int, int, str, tuple[str, ...]]]:
    """Every allocator event a finished ``torch.profiler.profile(profile_memory=True)`` recorded, in
    time order: (time ns, bytes (negative: a free), address, device type, names of the ops it
    happened in, outermost first). These come from the allocators themselves, so they include
    memory that no dispatcher op returns (Inductor-generated code's buffers, ops' internal
    workspaces)."""
    from torch._C._profiler import _EventType

    events, stack = [], [(e, ()) for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, within = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            events.append((event.start_time_ns, fields.alloc_size, fields.ptr, fields.device.type, within))
        else:
            stack.extend((child, within + (event.name,)) for child in event.children)
    return sorted(events, key=lambda e: e[:3])


def profiler_enabled() -> bool:
    """Whether a torch.profiler (or autograd profiler) is recording on this thread."""
    return torch.autograd.profiler._is_profiler_enabled
