"""Tier 0, checkpoints kept in cluster memory (SPEC §3): what the checkpoint steps, the sessions and
the commit pipeline say to each other about the node snapshots held in memory.

A node's snapshot of an epoch (its whole GLOBAL workspace, copied as a save would write it) is
kept in the memory of the node's worker and, as replicas, of other workers. The snapshots of the
nodes one worker serves travel and are held together, as one **bundle** per worker and epoch
(a :class:`HeldBundle`, node -> snapshot): Dask data of the driver's client under one key on the
worker, and under one key per replica on its peers, whatever the number of nodes. The steps hand a
node's snapshot to the :class:`SnapshotKeeper` of its state (worker side), as its
:class:`KeepOrder` says; the driver plans the bundles, checks, releases and restores through the
session's :class:`ClusterMemory`. No Dask here: the sessions implement both protocols.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypedDict

import numpy as np

from .._model.values import Value


@dataclass(frozen=True)
class Bundle:
    """The nodes a worker serves, as planned for an epoch: their snapshots go together, under
    :attr:`key` on :attr:`holder` and under each key of :attr:`replicas` on that key's worker."""

    key: str
    holder: str
    nodes: tuple[str, ...]
    replicas: Mapping[str, str] = field(default_factory=dict)

    def all_keys(self) -> list[str]:
        """The holder's key, then the replicas' keys."""
        return [self.key, *self.replicas]


@dataclass(frozen=True)
class KeepOrder:
    """Where the snapshot of ``node`` at ``epoch`` goes: into the bundle of :attr:`size` nodes held
    under :attr:`key` on :attr:`holder` and under each key of :attr:`replicas` on that key's worker,
    as data of :attr:`owner` (the driver's Dask client id; ``""`` in one process). It is what the
    node's hook carries, in every task of the epoch: its :class:`Bundle` without the other nodes'
    names (:meth:`of`)."""

    node: str
    epoch: int
    key: str
    holder: str
    size: int
    replicas: Mapping[str, str] = field(default_factory=dict)
    owner: str = ""

    @classmethod
    def of(cls, node: str, epoch: int, bundle: Bundle, owner: str = "") -> KeepOrder:
        """The order of ``node``, one of ``bundle``'s nodes."""
        return cls(node, epoch, bundle.key, bundle.holder, len(bundle.nodes), bundle.replicas, owner)

    def all_keys(self) -> list[str]:
        """The holder's key, then the replicas' keys."""
        return [self.key, *self.replicas]


class HeldBundle(Mapping[str, dict[str, Value]]):
    """A bundle's snapshots (node -> snapshot) as Dask holds and moves them: one object, whose size
    Dask takes from :attr:`nbytes` instead of measuring value by value, and which travels to a peer
    in one piece (pickled whole, its arrays as out-of-band buffers) instead of as a collection Dask
    walks and serialises element by element, several times slower for a bundle of many nodes.

    Examples
    --------
    >>> import numpy as np
    >>> bundle = HeldBundle({"ps": {"w": np.zeros(4)}}, 32)
    >>> list(bundle), bundle.nbytes, bundle["ps"]["w"].shape
    (['ps'], 32, (4,))
    """

    __slots__ = ("_snapshots", "nbytes")

    def __init__(self, snapshots: Mapping[str, dict[str, Value]], nbytes: int) -> None:
        self._snapshots = dict(snapshots)
        self.nbytes = nbytes

    def __getitem__(self, node: str) -> dict[str, Value]:
        return self._snapshots[node]

    def __iter__(self) -> Iterator[str]:
        return iter(self._snapshots)

    def __len__(self) -> int:
        return len(self._snapshots)

    def __sizeof__(self) -> int:
        return self.nbytes

    def __reduce__(self) -> tuple[type[HeldBundle], tuple[dict[str, dict[str, Value]], int]]:
        return (HeldBundle, (self._snapshots, self.nbytes))


class Kept(TypedDict):
    """What a keeper says of a snapshot it took: its bytes and the worker holding it (``holder``
    empty: the node did not run where its bundle was planned, so its snapshot is not kept)."""

    bytes: int
    holder: str


class PushFailure(TypedDict):
    """A bundle that could not be sent to a peer (reported by its nodes' next hooks)."""

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

    def keep(self, order: KeepOrder, snapshot: dict[str, Value], nbytes: int) -> Kept:
        """Add ``snapshot`` of ``nbytes`` bytes (:func:`snapshot_bytes`; not copied again: the caller
        made it) to its bundle; once every node of the bundle is in, the bundle is held here and sent,
        in the background, to its peers, and its keys are registered."""

    def failures(self, node: str) -> list[PushFailure]:
        """The replicas of ``node``'s bundles that could not be sent since the last call (then forgotten)."""


class ClusterMemory(Protocol):
    """The driver's side of tier 0 on a session: where the bundles go, which keys are held, and
    restoring node workspaces from them."""

    owner: str
    """Who the keys are held for (the driver's Dask client id; ``""`` in one process)."""

    def bundles(self, epoch: int, save_id: str, nodes: Sequence[str], replicas: int) -> list[Bundle]:
        """The bundles of ``nodes``' snapshots of ``epoch``: one per worker serving some of them, each
        replicated on up to ``replicas`` other workers."""

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
        """Make each node's workspace (``sources``: node -> the key of a bundle holding its snapshot)
        a copy of its snapshot, on the node's worker (the bundle travels there if held elsewhere)."""


def snapshot_bytes(snapshot: Mapping[str, Value]) -> int:
    """Bytes a snapshot holds: its arrays' data and its JSON values' text."""
    total = 0
    for value in snapshot.values():
        if isinstance(value, np.ndarray):
            total += int(value.nbytes)
        else:
            total += len(json.dumps(value))
    return total
