"""What runs on a node's worker: the steps that save a workspace (now, in the background, or from a
forked child) and load one, and the probes proving that driver and worker see one prefix.

Imports :mod:`._format`, :mod:`._storage` and :mod:`._protocol`; the managers put these steps into
the task groups they build.
"""
