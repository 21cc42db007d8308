"""Tier 0 on the driver: a run's epochs committed in cluster memory (SPEC §3), the second commit
tier of the :class:`~.pipeline.CommitPipeline`.

Every epoch each node's snapshot is kept by its worker and ``replicas`` peers (see
:mod:`daskjobs._execution.memory`). :class:`MemoryTier` holds the keys of the epochs in flight:
an epoch is **committed in memory** once it ran on every node and every key of it was registered
with the scheduler (each snapshot on ``1 + replicas`` distinct workers, or as many as the cluster
has). Then the epochs before it are released: the memory holds the newest committed epoch and the
ones after it. A recovery restores from the newest committed epoch whose every node still has a
copy (:meth:`MemoryTier.source`), reading nothing from the prefix.

:class:`MemoryOptions` are the manager's options of tier 0, and :meth:`MemoryOptions.durable_due`
says which epochs are also committed durably under the prefix.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..._execution.memory import KeepOrder
from ..._model.values import check_count, check_positive
from ...errors import DefinitionTypeError, JobDefinitionError
from .._node.outcomes import KeepOutcome

if TYPE_CHECKING:
    from ..._execution.memory import ClusterMemory, Kept, PushFailure

logger = logging.getLogger("daskjobs")

DEFAULT_DURABLE_EVERY = 10
"""Durable commits with tier 0 when ``durable_every`` is not given: every tenth epoch."""


@dataclass(frozen=True)
class MemoryOptions:
    """Tier 0 of a manager (``in_memory=True``): how many peers hold a replica of each snapshot,
    and which epochs are also committed durably."""

    replicas: int = 1
    durable_every: int | None = DEFAULT_DURABLE_EVERY
    """Every epoch divisible by it is committed durably (``None``: no durable commits, no prefix)."""
    durable_interval: float | None = None
    """An epoch at least this many seconds after the last durable one is committed durably."""

    def durable_due(self, epoch: int, *, last: bool, newest_durable: int | None, since: float | None) -> bool:
        """Whether ``epoch`` is committed durably too: epoch 0, the last epoch (when known), every
        multiple of :attr:`durable_every`, one ``durable_interval`` seconds (``since``: seconds since
        the last durable one started) after the last, and one whenever the newest durable epoch
        (committed, or being written: ``newest_durable``) lags more than ``durable_every`` behind (a
        durable write was given up, or a recovery from memory restored past it)."""
        if self.durable_every is None:
            return False
        if epoch == 0 or last or epoch % self.durable_every == 0:
            return True
        if self.durable_interval is not None and since is not None and since >= self.durable_interval:
            return True
        return newest_durable is None or epoch - newest_durable > self.durable_every


def memory_options(
    in_memory: object,
    durable_every: object,
    replicas: object,
    durable_interval: object,
    *,
    has_prefix: bool,
) -> MemoryOptions | None:
    """The manager's tier-0 options, checked (``None``: tier 0 is off).

    Raises
    ------
    DefinitionTypeError
        An option has the wrong type (``in_memory`` not a bool, ``replicas`` or ``durable_every``
        not an int, ``durable_interval`` not a number).
    JobDefinitionError
        An option has a value it cannot take, or is given without ``in_memory=True``, or
        ``durable_every``/``durable_interval`` with ``db_prefix=None`` (nothing durable to write).
    """
    if not isinstance(in_memory, bool):
        raise DefinitionTypeError(f"in_memory must be True or False, got {type(in_memory).__name__}: {in_memory!r}")
    given = {"durable_every": durable_every, "replicas": replicas, "durable_interval": durable_interval}
    if not in_memory:
        named = [name for name, value in given.items() if value is not None]
        if named:
            raise JobDefinitionError(
                f"{', '.join(named)}: options of checkpoints in cluster memory, which are off; add in_memory=True"
            )
        if not has_prefix:
            raise JobDefinitionError("db_prefix=None keeps checkpoints only in cluster memory: add in_memory=True")
        return None
    if not has_prefix:
        named = [name for name in ("durable_every", "durable_interval") if given[name] is not None]
        if named:
            raise JobDefinitionError(
                f"{' and '.join(named)}: options of durable commits, but db_prefix=None writes none; give a "
                "db_prefix or drop them"
            )
    every = None if not has_prefix else DEFAULT_DURABLE_EVERY
    if durable_every is not None:
        every = check_count(durable_every, "durable_every")
    copies = 1 if replicas is None else check_count(replicas, "replicas", minimum=0)
    interval = None if durable_interval is None else check_positive(durable_interval, "durable_interval (seconds)")
    return MemoryOptions(copies, every, interval)


@dataclass
class MemoryEpoch:
    """One epoch in tier 0: where each node's snapshot goes, what the nodes reported, what the
    epoch's commit holds besides (stop values, metrics), and whether it is committed in memory."""

    epoch: int
    orders: dict[str, KeepOrder]
    kept: dict[str, Kept] = field(default_factory=dict)
    stop_values: dict[str, bool] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    accepted: bool = False
    committed: bool = False

    @functools.cached_property
    def keys(self) -> tuple[str, ...]:
        """The keys of the epoch's bundles and of their replicas (the orders never change)."""
        return tuple(dict.fromkeys(key for order in self.orders.values() for key in order.all_keys()))

    def held(self) -> dict[str, tuple[int, str]]:
        """Key -> (bytes, the worker it was put on), for the bundles of the nodes that reported."""
        found: dict[str, tuple[int, str]] = {}
        for node, kept in self.kept.items():
            order = self.orders[node]
            for key, holder in [(order.key, order.holder), *order.replicas.items()]:
                nbytes, _ = found.get(key, (0, holder))
                found[key] = (nbytes + kept["bytes"], holder)
        return found


class MemoryTier:
    """A run's epochs in cluster memory, on the driver (see the module docstring), kept through the
    session's :class:`~daskjobs._execution.memory.ClusterMemory` (:meth:`connect`), and which of them
    are also made durable (:meth:`durable_due`)."""

    def __init__(self, options: MemoryOptions) -> None:
        self.options = options
        self.cluster: ClusterMemory | None = None
        self.last: int | None = None
        """The newest epoch committed in memory (``None``: none yet, or since a restore from the prefix)."""
        self.unproven = False
        """Whether the prefix must be proven shared before the next durable epoch (a restore from memory
        may have moved nodes to workers that never wrote there)."""
        self._epochs: dict[int, MemoryEpoch] = {}
        self._durable: tuple[int | None, float] = (None, time.monotonic())
        self._warned_few = False

    def connect(self, cluster: ClusterMemory) -> None:
        """Keep the snapshots in ``cluster`` (the session's memory) from now on."""
        self.cluster = cluster

    # -- durable epochs -----------------------------------------------------------------
    def durable_due(self, epoch: int, *, last: bool, committed: int | None) -> bool:
        """Whether ``epoch`` is committed durably too (see :meth:`MemoryOptions.durable_due`), the newest
        durable commit being ``committed``."""
        planned, at = self._durable
        newest = max((e for e in (planned, committed) if e is not None), default=None)
        return self.options.durable_due(epoch, last=last, newest_durable=newest, since=since(at))

    def writing_durably(self, epoch: int | None) -> None:
        """``epoch`` is being made durable now (``None``: the durable writes in flight were given up)."""
        self._durable = (epoch, time.monotonic() if epoch is not None else self._durable[1])

    # -- an epoch's way in --------------------------------------------------------------
    def orders(self, epoch: int, nodes: list[str]) -> dict[str, KeepOrder]:
        """Where each node's snapshot of ``epoch`` goes (an earlier attempt of it is dropped); its keys
        are held from now on, so their registration is heard."""
        self.drop(epoch)
        cluster, replicas = self.cluster, self.options.replicas
        assert cluster is not None
        bundles = cluster.bundles(epoch, uuid.uuid4().hex, nodes, replicas)
        fewest = min((len(b.replicas) for b in bundles), default=replicas)
        if fewest < replicas and cluster.owner and not self._warned_few:  # one process ("") holds no replicas
            self._warned_few = True
            logger.warning(
                "tier 0: the cluster has too few workers to hold each node's snapshot on 1 + %d (replicas=%d), "
                "only on %d: losing %s falls back to %s",
                replicas,
                replicas,
                fewest + 1,
                "a worker" if fewest == 0 else f"{fewest + 1} workers at once",
                "the durable checkpoints under the prefix"
                if self.options.durable_every is not None
                else "the start of the run (db_prefix=None: nothing durable)",
            )
        orders = {node: KeepOrder.of(node, epoch, bundle, cluster.owner) for bundle in bundles for node in bundle.nodes}
        record = self._epochs[epoch] = MemoryEpoch(epoch, orders)
        cluster.hold(record.keys)
        return orders

    def accept(
        self, epoch: int, finished: Mapping[str, Any], stop_values: Mapping[str, bool], metrics: Mapping[str, float]
    ) -> dict[str, Any]:
        """Take what ``epoch``'s hooks reported; return the nodes whose snapshot failed (their error),
        in which case the epoch is dropped: it is never committed in memory."""
        record = self._epochs.get(epoch)
        if record is None:
            return {}
        failed: dict[str, Any] = {}
        moved = []
        for node in record.orders:
            outcome = finished.get(node)
            if not isinstance(outcome, KeepOutcome):
                failed[node] = "no result"
            elif outcome.kept is not None and outcome.kept["holder"]:
                record.kept[node] = outcome.kept
            elif outcome.kept is not None:
                moved.append(node)
            else:
                failed[node] = outcome.error or "no snapshot"
        for node, outcome in finished.items():
            for failure in outcome.pushes if isinstance(outcome, KeepOutcome) else ():
                self._push_failed(node, failure, failed)
        if moved and not failed:
            logger.info("tier 0: epoch %d is not kept in memory: node(s) %s moved since it started", epoch, moved)
        if failed or moved:
            self.drop(epoch)
            return failed
        record.stop_values, record.metrics, record.accepted = dict(stop_values), dict(metrics), True
        if self.cluster is not None:  # once this epoch is committed, the ones before it go at once
            older = [key for e, r in self._epochs.items() if e < epoch for key in r.keys]
            self.cluster.release_when_held(record.keys, older)
        return {}

    def _push_failed(self, node: str, failure: PushFailure, failed: dict[str, Any]) -> None:
        """A replica of ``node`` could not be sent: its epoch is never committed in memory; a peer that
        left is routine (the next epoch has other peers), anything else fails the epoch too."""
        logger.info(
            "tier 0: the replica of node %r, epoch %d, could not be sent to %s: %s",
            node,
            failure["epoch"],
            failure["peer"],
            failure["error"],
        )
        if failure["fatal"]:
            failed[node] = (
                f"its replica of epoch {failure['epoch']} could not go to {failure['peer']}: {failure['error']}"
            )
        self.drop(failure["epoch"])

    # -- commits ------------------------------------------------------------------------
    def observe(self) -> list[int]:
        """Commit in memory, oldest first, the epochs that ran and whose every key is registered;
        release the epochs before the newest committed one. Returns the epochs committed now."""
        newly = []
        for epoch in sorted(self._epochs):
            record = self._epochs[epoch]
            if not record.accepted or record.committed or self.cluster is None:
                continue
            if all(self.cluster.registered(record.keys).values()):
                record.committed = True
                newly.append(epoch)
                self.last = epoch
        if self.last is not None:
            for epoch in [e for e in self._epochs if e < self.last]:
                self.drop(epoch)
        return newly

    def newest_accepted(self) -> int | None:
        """The newest epoch that ran on every node and kept its snapshots (committed or not yet)."""
        return max((e for e, r in self._epochs.items() if r.accepted), default=None)

    def record(self, epoch: int) -> MemoryEpoch | None:
        return self._epochs.get(epoch)

    def tier0_bytes(self) -> dict[str, int]:
        """Worker address -> bytes of the committed snapshots it holds (its nodes' and its replicas),
        as placed. The snapshots of the next epoch join them for the moment between its end and its
        commit, when the older ones are released."""
        total: dict[str, int] = {}
        for record in self._epochs.values():
            if not record.committed:
                continue
            for nbytes, holder in record.held().values():
                total[holder] = total.get(holder, 0) + nbytes
        return dict(sorted(total.items()))

    # -- recovery -----------------------------------------------------------------------
    def source(self, not_before: int | None) -> tuple[int, dict[str, str]] | None:
        """The newest epoch committed in memory (not older than ``not_before``: the newest durable
        commit) whose every node still has a copy, with the key to restore each node from (its own
        worker's copy where it survives); ``None`` when there is none. Asks the scheduler once."""
        self.observe()
        candidates = sorted(
            (r for r in self._epochs.values() if r.committed and (not_before is None or r.epoch >= not_before)),
            key=lambda r: -r.epoch,
        )
        if not candidates or self.cluster is None:
            return None
        holders = self.cluster.holders([key for record in candidates for key in record.keys])
        for record in candidates:
            sources = {}
            for node, order in record.orders.items():
                held = [key for key in order.all_keys() if holders.get(key)]
                if not held:
                    logger.info(
                        "tier 0: epoch %d cannot be restored from memory: no copy of node %r's snapshot is left",
                        record.epoch,
                        node,
                    )
                    break
                sources[node] = held[0]
            else:
                return record.epoch, sources
        return None

    def restore(self, source: tuple[int, dict[str, str]]) -> MemoryEpoch:
        """Restore every node from ``source`` (see :meth:`source`) and return that epoch's record; the
        other epochs are dropped. The durable writes in flight ended with the loss; the next durable
        epoch first proves the prefix shared (the nodes may be on other workers now)."""
        epoch, keys = source
        record = self._epochs[epoch]
        assert self.cluster is not None
        self.cluster.restore(keys)
        self._restarted(epoch)
        self.last, self.unproven = epoch, True
        self.writing_durably(None)
        return record

    def restarted(self, durable: int | None) -> None:
        """The nodes were restored from the prefix's epoch ``durable`` (``None``: from scratch): every
        epoch held is dropped."""
        self._restarted(None)
        self.last = None
        self.writing_durably(durable)

    def _restarted(self, keep: int | None) -> None:
        for other in [e for e in self._epochs if e != keep]:
            self.drop(other)
        if self.cluster is not None:
            self.cluster.forget_workers()

    # -- letting go ---------------------------------------------------------------------
    def drop(self, epoch: int) -> None:
        """Forget ``epoch`` and let the cluster drop its snapshots."""
        record = self._epochs.pop(epoch, None)
        if record is not None and self.cluster is not None:
            self.cluster.release(record.keys)

    def close(self) -> None:
        """The run ends: every snapshot is released."""
        for epoch in list(self._epochs):
            self.drop(epoch)


def since(moment: float | None) -> float | None:
    """Seconds since ``moment`` (``time.monotonic``), or ``None``."""
    return None if moment is None else time.monotonic() - moment
