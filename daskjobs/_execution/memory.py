"""Tier 0, checkpoints kept in cluster memory (SPEC §3): what the checkpoint steps, the sessions and
the commit pipeline say to each other about a node's snapshot held in memory.

A node's snapshot of an epoch (its whole GLOBAL workspace, copied as a save would write it) is
kept on the node's own worker under a key and, as replicas, on other workers under keys of their
own: Dask data of the driver's client on a ``DaskSession``, a copy in the process on a
``LocalSession``. The steps hand a snapshot to the :class:`SnapshotKeeper` of the node's state
(worker side); the driver holds, checks, releases and restores through the session's
:class:`ClusterMemory`. No Dask here: the sessions implement both protocols.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypedDict

import numpy as np

from .._model.values import Value


@dataclass(frozen=True)
class KeepOrder:
    """Where the snapshot of ``node`` at ``epoch`` goes: under :attr:`key` on the node's own worker,
    under each key of :attr:`replicas` on that key's worker (peer address), all held by
    :attr:`owner` (the driver's Dask client id; ``""`` in one process)."""

    node: str
    epoch: int
    key: str
    replicas: Mapping[str, str] = field(default_factory=dict)
    owner: str = ""

    def all_keys(self) -> list[str]:
        """The node's own key, then its replicas' keys."""
        return [self.key, *self.replicas]


class Kept(TypedDict):
    """What a keeper says of a snapshot it took: its bytes and the address of the worker holding it."""

    bytes: int
    holder: str


class PushFailure(TypedDict):
    """A replica that could not be sent to its peer (reported by the node's next hook)."""

    epoch: int
    peer: str
    error: str
    fatal: bool
    """``False`` when the peer left (the next epoch picks other peers); ``True`` otherwise."""


class SnapshotKeeper(Protocol):
    """Keeps node snapshots in the memory of the worker (or process) a node's state lives in."""

    def check_fits(self, order: KeepOrder, nbytes: int) -> None:
        """Raise :class:`~daskjobs.errors.CheckpointWriteError` when a snapshot of ``nbytes`` (and
        its replicas) would not fit in the worker's memory limit: before the snapshot is made."""

    def keep(self, order: KeepOrder, snapshot: dict[str, Value]) -> Kept:
        """Hold ``snapshot`` (not copied again: the caller made it) under ``order.key`` and send its
        replicas, in the background, to ``order.replicas``' peers; their keys are registered once
        stored."""

    def failures(self, node: str) -> list[PushFailure]:
        """The replicas of ``node`` that could not be sent since the last call (then forgotten)."""


class ClusterMemory(Protocol):
    """The driver's side of tier 0 on a session: which peers hold replicas, which keys are held,
    and restoring node workspaces from them."""

    owner: str
    """Who the keys are held for (the driver's Dask client id; ``""`` in one process)."""

    def key(self, epoch: int, save_id: str, node: str, copy: int) -> str:
        """The key of copy ``copy`` (0: the node's own worker) of ``node``'s snapshot of ``epoch``."""

    def peers(self, nodes: Sequence[str], replicas: int) -> dict[str, list[str]]:
        """Per node, up to ``replicas`` workers other than its own to hold its replicas."""

    def forget_workers(self) -> None:
        """Look at the cluster's workers afresh before choosing the next peers (after a loss)."""

    def hold(self, keys: Iterable[str]) -> None:
        """Hold ``keys`` for this driver (before they are stored: their registration is awaited)."""

    def registered(self, keys: Iterable[str]) -> dict[str, bool]:
        """Whether each key was stored and registered (also when its holders have left since)."""

    def holders(self, keys: Iterable[str]) -> dict[str, list[str]]:
        """The workers holding each key now (asked afresh)."""

    def release(self, keys: Iterable[str]) -> None:
        """Let the cluster drop ``keys``."""

    def release_when_held(self, keys: Iterable[str], older: Iterable[str]) -> None:
        """Release ``older`` as soon as every key of ``keys`` is registered (unless one of ``keys`` is
        released first): the snapshots an epoch committed in memory supersedes go at once."""

    def restore(self, sources: Mapping[str, str]) -> None:
        """Make each node's workspace (``sources``: node -> key) a copy of the snapshot under its key,
        on the node's worker (the snapshot travels there if it is held elsewhere)."""


def snapshot_bytes(snapshot: Mapping[str, Value]) -> int:
    """Bytes a snapshot holds: its arrays' data and its JSON values' text."""
    total = 0
    for value in snapshot.values():
        if isinstance(value, np.ndarray):
            total += int(value.nbytes)
        else:
            total += len(json.dumps(value))
    return total
