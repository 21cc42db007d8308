"""Recovering a run from a lost node: whether one more recovery is allowed, waiting for every node
and emptying the workspaces before a restore, and what a lost session says about resuming."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ._model.group import TaskGroup
from ._model.task import Task, WorkspaceType
from .errors import NodeLostError, SessionLostError

if TYPE_CHECKING:
    from .checkpoint import MultiNodeCheckpointManager
    from .session import Session

logger = logging.getLogger("daskjobs")

RECOVERY_WAIT = 60.0
"""Seconds a recovery waits for every node to have a worker again (a restarted worker process
needs a few seconds, more on a loaded machine)."""

MAX_DEPARTURES_IN_A_ROW = 10
"""Planned departures (see :attr:`~daskjobs.errors.NodeLostError.departure`) a run recovers from
between two commits without counting them as failures; more count against ``max_failures``
(workers that leave faster than an epoch commits would otherwise loop forever)."""


def with_last_commit(exc: SessionLostError, manager: MultiNodeCheckpointManager) -> SessionLostError:
    """``exc`` told with the last committed epoch and how to resume from it."""
    try:
        epochs = manager.store.committed_epochs()
    except OSError as error:
        where = f"the committed epochs under {manager.store.url} could not be listed ({error})"
    else:
        where = f"last committed epoch {epochs[-1]} under {manager.store.url}" if epochs else "no epoch was committed"
    return SessionLostError(f"{exc}; {where}: run the job again on a working scheduler to resume")


def check_recoverable(
    manager: MultiNodeCheckpointManager | None, exc: NodeLostError, failures: int, max_failures: int, last: int | None
) -> None:
    """Raise the final :class:`NodeLostError` unless one more recovery is allowed.

    ``last`` is the newest epoch the run committed (``None``: none), named in the error.
    """
    if manager is not None and failures < max_failures:
        return
    where = "no committed epoch" if last is None else f"last committed epoch {last}"
    why = "no checkpoint manager" if manager is None else f"giving up after {failures} recoveries"
    raise NodeLostError(f"{exc} — {why} ({where})", exc.nodes) from exc


def prepare_restore(
    session: Session,
    nodes: list[str],
    latest: int | None,
    timeout: float,
    *,
    lost: list[str],
    departed: str | None,
    failures: tuple[int, int],
) -> None:
    """Before restoring from ``latest`` (``None``: from scratch) after the loss of the nodes ``lost``:
    wait up to ``timeout`` seconds for every node to have a worker again, forget the session's
    tokens, and without a commit empty the nodes' GLOBAL workspaces (init then runs again).

    Logs one line: an INFO naming the nodes and ``departed`` (why their worker left) for a planned
    departure, else a WARNING with the ``(failures, max_failures)`` count.
    """
    start = "scratch" if latest is None else f"epoch {latest}"
    if departed is not None:
        logger.info(
            "node(s) %s: the worker left on purpose (%s); waiting for its replacement and restoring all nodes "
            "from %s (a planned departure, not counted against max_failures)",
            lost,
            departed,
            start,
        )
    else:
        logger.warning("node(s) %s lost; restoring all nodes from %s (recovery %d of %d)", lost, start, *failures)
    wait = getattr(session, "wait_for_nodes", None)
    if wait is not None:
        wait(nodes, timeout=timeout)
    session.forget_tokens()
    if latest is None:
        session.run(_clear_group(nodes))


def _clear_workspace(ws: Any) -> None:
    """Step: empty the node's GLOBAL workspace (before init runs again after a node loss)."""
    ws._state.replace_blobs({})


def _clear_group(nodes: list[str]) -> TaskGroup:
    with TaskGroup(WorkspaceType.GLOBAL) as group:
        for node in nodes:
            Task(_clear_workspace, node=node, name="clear_workspace")
    return group
