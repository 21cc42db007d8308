"""The public faces of checkpoints: managers that save and load node workspaces as task groups and
commit epochs, metadata handlers, upload builders, and read-only views of committed checkpoints.

Imports every other part of :mod:`daskjobs.checkpoint`; nothing in the package imports it except
the package's ``__init__``.
"""
