"""Compiling one input signature of a parallelized module into its per-rank program, stage by stage:

capture.py (the joint forward+backward aten graph; decompositions.py for ops captured in another
form, annotations.py for the plan's marker ops), then the rewrites and propagation
(passes/__init__.py:REWRITES, propagation/), lower.py (local graph with explicit collectives), the
passes (passes/), the forward/backward partition (runtime/partition.py) and the SPMD check;
driver.py runs them in that order for the plain and the pipelined path, with options.py's
``CompileOptions``.
"""
