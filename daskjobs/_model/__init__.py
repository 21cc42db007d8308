"""The pure job model: nodes, tasks, groups and jobs. No Dask, no Zarr, no I/O."""
