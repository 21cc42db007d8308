"""Caffe2's checkpoint naming: ``<node>.<epoch>`` under a prefix."""

from __future__ import annotations


def get_ckpt_filename(node: str, epoch: int) -> str:
    """The checkpoint name of a node at an epoch: ``"<node>.<epoch>"``."""
    return f"{node}.{epoch}"


def db_name(epoch: int, node: str, db_prefix: str, path_prefix: str | None = None) -> str:
    """Where a node's checkpoint of ``epoch`` lives: ``"<db_prefix>/<node>.<epoch>"``.

    A non-empty ``path_prefix`` is prepended as it is, without a separator (as in Caffe2).

    Examples
    --------
    >>> db_name(5, "trainer_0", "T")
    'T/trainer_0.5'
    """
    name = get_ckpt_filename(node, epoch)
    if path_prefix:
        return f"{path_prefix}{name}"
    return f"{db_prefix.rstrip('/')}/{name}"
