"""Bytes on a disk or an object store: one node's group written, made durable, read and deleted.

The storage protocol, its capabilities and optional parts (:mod:`.base`), implemented for local
files with fsync (:mod:`.files`, :mod:`.durable`) and any other fsspec filesystem (:mod:`.remote`);
a node's group as a Zarr v3 group (:mod:`.zarr_groups`, the only module of daskjobs that imports
``zarr``), read back verified (:mod:`.reader`, its metadata held against the commit record by
:mod:`.group_metadata`), and deleting only what daskjobs provably wrote (:mod:`.cleanup`).

Imports :mod:`._format` and the layers below the checkpoint package; knows nothing of commits,
locks or managers.
"""
