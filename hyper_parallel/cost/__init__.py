"""Cost model: estimated step time of the compiled per-rank programs on a hardware profile.

``hardware`` (peak rates per device and fabric), ``compute`` (FLOPs and bytes per node, roofline
time), ``comm`` (alpha-beta time per collective, intra- vs inter-node by group placement),
``simulate`` (compute and communication streams over the forward and backward programs, exposed
communication, MFU), ``trace`` (Chrome trace JSON of the simulated step)::

    from hyper_parallel.cost import axis_infos, get_profile, simulate, to_chrome_trace
    est = simulate(pmodel.compiled_programs(), axis_infos(mesh), get_profile("h100"))
    print(est)                                   # step, compute, comm, exposed comm, FLOPs
    json.dump(to_chrome_trace(est.timeline), open("step.json", "w"))
"""

from .comm import AxisInfo, agreement_time, axis_infos, axis_table, collective_time
from .compute import NodeWork, node_work, roofline_time
from .hardware import PROFILES, HardwareProfile, get_profile
from .simulate import Event, StepEstimate, Timeline, mfu, optimizer_time, optimizer_traffic, simulate, simulate_program
from .trace import to_chrome_trace

__all__ = [
    "AxisInfo",
    "Event",
    "HardwareProfile",
    "NodeWork",
    "PROFILES",
    "StepEstimate",
    "Timeline",
    "agreement_time",
    "axis_infos",
    "axis_table",
    "collective_time",
    "get_profile",
    "mfu",
    "node_work",
    "optimizer_time",
    "optimizer_traffic",
    "roofline_time",
    "simulate",
    "simulate_program",
    "to_chrome_trace",
]
