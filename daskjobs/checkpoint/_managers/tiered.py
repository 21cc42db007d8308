"""The commit pipeline of a run with tier 0 (``MultiNodeCheckpointManager(in_memory=True)``): every
epoch committed in cluster memory first (SPEC §3), some of them also durably.

:class:`TieredPipeline` is a :class:`~.pipeline.CommitPipeline` whose epochs' hooks
(``KeepFinish``) keep each node's snapshot in the memory of its worker and of its peers
(:class:`~.memory.MemoryTier`, the second commit tier); an epoch is committed in memory once every
snapshot is registered, which the pipeline looks for whenever it takes the nodes' reports and while
the next epoch runs. The epochs the manager's options make durable are written from the same
snapshot, in the background, and committed as the base pipeline commits every epoch; the last
epoch of a run (and the one a graceful stop ends with) is made durable when it is not. After a
lost worker, nothing is read from the prefix: no flush is made from here and no leftover is removed
before the run ends; the runner restores from memory where it can (``MemoryTier.source``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ...errors import CheckpointWriteError
from .._format.records import record_bytes
from .._node.memory_steps import KeepFinish
from .._node.outcomes import KeepOutcome
from .ledger import write_error
from .memory import MemoryTier
from .pipeline import CommitPipeline
from .saving import FATAL, OnCommit, OnMemoryCommit, Saved, SaveMode, SavePlan, SavePolicy

if TYPE_CHECKING:
    from ..._model.group import TaskGroup
    from ...session import Session
    from .writer import EpochWriter

logger = logging.getLogger("daskjobs")


class TieredPipeline(CommitPipeline):
    """A :class:`~.pipeline.CommitPipeline` committing every epoch in cluster memory first (see the
    module docstring). ``on_memory_commit(epoch, tier0_bytes)`` is told of each commit in memory."""

    def __init__(
        self,
        writer: EpochWriter,
        policy: SavePolicy | None = None,
        on_commit: OnCommit | None = None,
        *,
        save_group: Callable[[int], TaskGroup] | None = None,
        on_memory_commit: OnMemoryCommit | None = None,
    ) -> None:
        super().__init__(writer, policy, on_commit, save_group=save_group)
        options = writer.manager.memory_options
        assert options is not None
        self.tier = MemoryTier(options)
        self.memory = self.tier
        self.on_memory_commit = on_memory_commit

    # -- saving an epoch --------------------------------------------------------------------
    def plan(
        self,
        epoch: int,
        used_nodes: list[str],
        *,
        background: bool,
        last: bool = False,
        session: Session | None = None,
    ) -> SavePlan:
        """Hooks keeping each node's snapshot in ``session``'s cluster memory (``KeepFinish``), in the
        epoch's graph (else run alone, see :meth:`accept`); on the epochs the manager makes durable
        they also write the snapshot under the prefix (in the background unless ``last``)."""
        if session is None:
            return super().plan(epoch, used_nodes, background=background, last=last)
        manager, tier = self.writer.manager, self.tier
        nodes = manager.nodes()
        if tier.cluster is None:
            if session.memory is None:
                raise CheckpointWriteError(
                    f"{type(session).__name__} keeps no checkpoints in cluster memory: in_memory=True needs a "
                    "LocalSession or a DaskSession"
                )
            tier.connect(session.memory)
        durable = tier.durable_due(epoch, last=last, committed=self.last_committed)
        if durable and not manager.cp_accessible(epoch=None):
            logger.warning("checkpoint storage not accessible: epoch %d is kept in cluster memory only", epoch)
            durable = False
        writes = {}
        if durable:
            try:
                if tier.unproven:
                    manager.check_shared(session)
                    tier.unproven = False
                writes = self.writer.durable_writes(epoch, nodes, background=background and not last)
            except FATAL:
                raise
            except Exception as exc:
                self._give_up(epoch, exc)
                durable = False
            else:
                tier.writing_durably(epoch)
        orders = tier.orders(epoch, nodes)
        hooks = {node: KeepFinish(orders[node], writes.get(node)) for node in nodes}
        if self.save_group is not None or not set(nodes) <= set(used_nodes):
            return SavePlan(epoch, SaveMode.OWN_GROUP, hooks, durable=durable, memory=True)
        self._unsure = True
        return SavePlan(epoch, SaveMode.IN_GRAPH, hooks, durable=durable, memory=True)

    def accept(
        self,
        session: Session,
        plan: SavePlan,
        finished: Mapping[str, Any],
        stop_values: Mapping[str, bool],
        metrics: Mapping[str, float],
    ) -> Saved:
        """Take the nodes' snapshots (one that failed is a save error, by policy), the reports of
        earlier background writes and, on a durable epoch, its save; commit in memory what is ready.
        Hooks that could not run in the epoch's graph run now, alone."""
        if not plan.memory:
            return super().accept(session, plan, finished, stop_values, metrics)
        self.check(plan.epoch)
        started, epoch = time.perf_counter(), plan.epoch
        if plan.mode is SaveMode.OWN_GROUP:
            keep = {node: KeepFinish(hook.order) for node, hook in plan.hooks.items() if isinstance(hook, KeepFinish)}
            with self._writing():
                finished = self.writer.run_hooks(session, "checkpoint_keep", keep, epoch)
        failed = self.tier.accept(epoch, finished, stop_values, metrics)
        if failed:
            self._give_up(epoch, write_error(epoch, failed))
        if plan.durable and plan.mode is SaveMode.IN_GRAPH:
            saved = super().accept(session, plan, _saves(finished), stop_values, metrics)
            if any(isinstance(r, KeepOutcome) and r.save is not None and r.save.later for r in finished.values()):
                saved = replace(saved, bytes=None)  # written in the background: the bytes come with its commit
        else:
            self._unsure = False
            self._take_flushes(session, finished)
            saved = Saved(time.perf_counter() - started)
            if plan.durable:
                saved = self.save(session, epoch, stop_values, metrics)
        self._observe()
        newest = self.newest_commit
        held = self.tier.tier0_bytes() if newest is not None and newest >= epoch else None
        return replace(saved, tier="durable" if plan.durable else "memory", tier0_bytes=held)

    def _take_flushes(self, session: Session, finished: Mapping[str, object]) -> None:
        """Take the reports of earlier background writes that hooks gave (a failed one written again)."""
        for other, errors in sorted(self.ledger.note_flushes(_saves(finished)).items()):
            self._write_again(session, other, errors)

    def drop(self, session: Session, plan: SavePlan, finished: Mapping[str, Any]) -> None:
        self.tier.drop(plan.epoch)
        if plan.memory and not plan.durable:
            self.check(plan.epoch)
            if plan.mode is SaveMode.IN_GRAPH:
                self._unsure = False
                self._take_flushes(session, finished)
            return
        super().drop(session, plan, _saves(finished))

    def salvage(self, plan: SavePlan, finished: Mapping[str, Any]) -> None:
        self.tier.drop(plan.epoch)
        super().salvage(plan, _saves(finished))

    # -- commits ----------------------------------------------------------------------------
    def meanwhile(self) -> None:
        super().meanwhile()
        try:
            self._observe()
        except Exception as exc:
            self._deferred_error = exc

    def flush(self, session: Session) -> None:
        super().flush(session)
        self._observe()

    def finish(self, session: Session) -> None:
        """Make the epoch run last durable too (a group saving the nodes' workspaces, which hold it)
        unless it is or is being, then commit every epoch (:meth:`flush`)."""
        tier = self.tier
        last = tier.newest_accepted()
        record = None if last is None else tier.record(last)
        durable = -1 if self.last_committed is None else self.last_committed
        writes = tier.options.durable_every is not None
        if writes and record is not None and durable < record.epoch and record.epoch not in self.ledger.ids:
            self.save(session, record.epoch, record.stop_values, record.metrics)
            tier.writing_durably(record.epoch)
        self.flush(session)

    def when_committed(self, call: Callable[[], object], epoch: int | None = None) -> None:
        """Call ``call`` once ``epoch`` (the last epoch run) is committed: in memory, or durably when it
        is an epoch made durable; after the calls kept for earlier epochs."""
        if epoch is None:
            super().when_committed(call)
            return
        durable = epoch in self.ledger.ids or any(w.epoch == epoch for w in self._waiting)
        done = self.last_committed if durable else self.newest_commit
        if self._then or done is None or done < epoch:
            self._then.append((epoch, durable, call))
        else:
            call()

    @property
    def newest_commit(self) -> int | None:
        known = [e for e in (self.last_committed, self.tier.last) if e is not None]
        return max(known, default=None)

    def _call_then(self, epoch: int, *, memory: bool = False) -> None:
        """The calls kept for ``epoch`` and those before it, in order; ``memory``: ``epoch`` is committed
        in memory only, which does not do for a call waiting for a durable commit (nor those after it)."""
        record = self.writer.last_commit
        if not memory and self.on_commit is not None and record is not None and record["epoch"] == epoch:
            self.on_commit(epoch, *record_bytes(record)[1:])
        now = []
        while self._then and self._then[0][0] <= epoch and not (memory and self._then[0][1]):
            now.append(self._then.pop(0)[2])
        for call in now:
            call()
        if not memory and self.tier.last is not None and self.tier.last > epoch:
            self._call_then(self.tier.last, memory=True)

    def _observe(self) -> None:
        """Commit in memory the epochs whose snapshots are all registered, telling
        :attr:`on_memory_commit` and making their calls."""
        for epoch in self.tier.observe():
            if self.on_memory_commit is not None:
                self.on_memory_commit(epoch, self.tier.tier0_bytes())
            self._call_then(epoch, memory=True)

    # -- the way out ------------------------------------------------------------------------
    def settle(self, session: Session | None = None) -> bool:
        """As the base pipeline settles, and the epochs committed in memory get their calls first (a
        recovery goes on after them)."""
        try:
            self._observe()
            if self.tier.last is not None:
                self._call_then(self.tier.last)
        except Exception as exc:
            logger.warning("%s", exc)
        return super().settle(session)

    def _flush_here(self, epoch: int) -> bool:
        """Nothing is read from the prefix after a loss: an epoch whose flush no node reported is not
        committed (memory holds newer epochs; the durable tier catches up at its next durable epoch)."""
        return False

    def recover(self, session: Session, lost: list[str]) -> None:
        """End the other nodes' background writes; what this run left uncommitted is removed when it
        ends (a recovery from memory reads nothing from the prefix)."""
        self.debris = True
        self.end_writes(session, lost)

    def recovered(self, epoch: int | None, *, in_memory: bool) -> None:
        if not in_memory:
            self.tier.restarted(epoch)

    def close(self) -> None:
        self.tier.close()
        super().close()


def _saves(finished: Mapping[str, object]) -> dict[str, object]:
    """What the hooks said of the nodes' durable writes, as the base pipeline takes it: a tier-0
    hook's save or flush report (a node whose background write still runs reports nothing)."""
    saves = {}
    for node, result in finished.items():
        report = result.reports() if isinstance(result, KeepOutcome) else result
        if report is not None:
            saves[node] = report
    return saves
