"""The pure job model: what a job is, before anything runs.

Nodes (:mod:`.node`), tasks and their outputs (:mod:`.task`), task groups (:mod:`.group`) and
jobs (:mod:`.job`); the rules for names and for the values a workspace holds (:mod:`.values`),
workspaces themselves (:mod:`.workspace`), the metrics steps log (:mod:`.metrics`) and the
``with``-block context (:mod:`.context`).

It imports :mod:`daskjobs.errors`, numpy and the standard library only: no Dask, no Zarr, no
I/O (``tests/test_imports.py`` and ``tests/test_layers.py`` hold it to that). Everything else in
daskjobs builds on it.
"""
