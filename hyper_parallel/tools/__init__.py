"""The ``hyper-parallel`` command line and what it runs.

``cli`` (``hyper-parallel explain`` / ``report``, also ``python -m hyper_parallel``) · ``explain``
(compile on the fake backend and describe one rank: memory, collectives, step time) · ``presets``
(the models, plans and meshes the command line names) · ``report/`` (one HTML page from a dump
directory). Nothing is imported here."""
