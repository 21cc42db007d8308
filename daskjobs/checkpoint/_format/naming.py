"""Caffe2's checkpoint naming: ``<node>.<epoch>`` under a prefix."""

from __future__ import annotations

import os

from ..._model.values import validate_name
from .entries import check_epoch


def get_ckpt_filename(node: str, epoch: int) -> str:
    """The checkpoint name of a node at an epoch: ``"<node>.<epoch>"``.

    ``node`` is a node name (or a :class:`~daskjobs.Node`), ``epoch`` an int from 0.

    Raises
    ------
    JobDefinitionError
        A bad node name or epoch (a ``ValueError``): a name must never lead out of the prefix.

    Examples
    --------
    >>> get_ckpt_filename("trainer_0", 5)
    'trainer_0.5'
    """
    name = node if isinstance(node, str) else str(node)
    return f"{validate_name(name, 'node')}.{check_epoch(epoch)}"


def db_name(epoch: int, node: str, db_prefix: str | os.PathLike[str], path_prefix: str | None = None) -> str:
    """Where a node's checkpoint of ``epoch`` lives: ``"<db_prefix>/<node>.<epoch>"``.

    ``db_prefix`` is a local path (``str`` or ``pathlib.Path``) or an fsspec URL. A non-empty
    ``path_prefix`` is prepended as it is, without a separator (as in Caffe2).

    Raises
    ------
    JobDefinitionError
        A bad node name or epoch (see :func:`get_ckpt_filename`).

    Examples
    --------
    >>> db_name(5, "trainer_0", "T")
    'T/trainer_0.5'
    """
    name = get_ckpt_filename(node, epoch)
    if path_prefix:
        return f"{os.fspath(path_prefix)}{name}"
    return f"{os.fspath(db_prefix).rstrip('/')}/{name}"
