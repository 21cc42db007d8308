"""Running a TaskGroup on its nodes: the layer between the pure model and the sessions.

* :mod:`.lowering` compiles a used group into one plan per node (:mod:`.plan`) and a run of it
  into a keyed Dask task graph, placed by node;
* :mod:`.shipping` is how a node's plan travels to the worker that runs it (cloudpickle bytes
  per task) and turns back into functions there; :mod:`.sources` keeps the steps' file names;
* :mod:`.node_run` runs a node's share of a group run against its workspace.

It imports the model (:mod:`daskjobs._model`) and :mod:`daskjobs.errors` only: no Dask
``distributed``, no Zarr, no I/O. Sessions and the checkpoint steps import it.
"""
