"""Chrome trace-event JSON of a simulated step, for Perfetto (ui.perfetto.dev) or chrome://tracing.

One process ("rank"), one thread per stream (compute, comm), one complete event (``"ph": "X"``)
per timeline event with ``ts``/``dur`` in microseconds and the node, module, op, FLOPs and bytes
in ``args``. Thread-name metadata events label the rows.
"""

from __future__ import annotations

from .simulate import Timeline

__all__ = ["to_chrome_trace"]

_TIDS = {"compute": 0, "comm": 1}


def to_chrome_trace(timeline: Timeline, rank: int = 0, name: str = "hyper_parallel estimate") -> dict:
    """The trace as a dict; ``json.dump`` it to a ``.json`` file and open it in Perfetto."""
    events = [
        {"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"{name} (rank {rank})"}},
    ]
    streams = sorted({e.stream for e in timeline.events} | set(_TIDS), key=lambda s: (_TIDS.get(s, 99), s))
    tids = {s: _TIDS.get(s, i + len(_TIDS)) for i, s in enumerate(streams)}
    for stream, tid in tids.items():
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": stream}})
    for e in timeline.events:
        events.append({
            "name": e.name,
            "cat": e.category,
            "ph": "X",
            "pid": rank,
            "tid": tids[e.stream],
            "ts": e.start_s * 1e6,
            "dur": (e.end_s - e.start_s) * 1e6,
            "args": {"node": e.node, "module": e.module, "op": e.op, "phase": e.phase, "flops": e.flops,
                     "bytes": e.bytes},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}
