"""What a run and the commit pipeline say to each other about saving an epoch: how it is saved
(:class:`SavePlan`), what saving it cost (:class:`Saved`), what the run decides when a save fails
(:class:`SavePolicy`: the runner's ``save_retries`` and ``on_save_error``) and what it hears of the
commits (:data:`OnCommit`)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...errors import CheckpointLockedError, NodeLostError, SessionClosedError, SessionLostError

Hook = Callable[[Any], Any]
"""A ``finish`` hook: called with the node's state at the end of its share of a group run."""

FATAL = (NodeLostError, CheckpointLockedError, SessionLostError, SessionClosedError)
"""Errors no save retries: the run itself cannot go on as it is."""


class SavePolicy(Protocol):
    """What a run does when a save fails (the runner's ``save_retries`` and ``on_save_error``). The
    commit pipeline tries a save up to :attr:`retries` more times (not after a :data:`FATAL` error),
    telling the policy of each failure (:meth:`failed`), then gives up (:meth:`give_up`)."""

    @property
    def retries(self) -> int:
        """How often a failed save is tried again."""

    def failed(self, epoch: int, number: int, error: BaseException) -> None:
        """Attempt ``number`` (from 0) of saving ``epoch`` failed with ``error``: log it, and wait a
        little before the next attempt."""

    def give_up(self, epoch: int, error: BaseException | None) -> None:
        """A save of ``epoch`` failed for good: raise ``CheckpointWriteError``, or warn, by policy."""


OnCommit = Callable[[int, int, int], None]
"""Told of each epoch the pipeline commits: ``(epoch, bytes_written, bytes_reused)`` of its save (the
runner: history bytes, ``epoch_committed`` hooks)."""


class SaveMode(enum.Enum):
    """How an epoch is saved: inside its own graph, as a group of its own after it, or not at all."""

    IN_GRAPH = "in_graph"
    OWN_GROUP = "own_group"
    SKIP = "skip"


@dataclass(frozen=True)
class SavePlan:
    """How :meth:`CommitPipeline.plan` saves ``epoch``; ``hooks`` (node -> ``finish`` hook) in the graph.

    With tier 0 (``memory``) the hooks keep the nodes' snapshots in cluster memory, and
    ``durable`` says whether the epoch is also committed under the prefix. ``defer_commit``: the
    epoch's commit may wait while the next epoch runs (``None``: the writer is asked once it ran);
    ``nodes``: the checkpointed nodes whose hooks save it (empty: the manager's)."""

    epoch: int
    mode: SaveMode
    hooks: Mapping[str, Hook] = field(default_factory=dict)
    durable: bool = True
    memory: bool = False
    defer_commit: bool | None = None
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Saved:
    """What saving an epoch cost the loop (node-side save seconds plus the driver's part), and the bytes
    its save wrote and reused (``None`` until the commit of a save written in the background brings
    them); ``tier``: ``"memory"`` or ``"durable"``, where the epoch is committed (``None``: no tier 0)."""

    seconds: float = 0.0
    bytes: tuple[int, int] | None = (0, 0)
    tier: str | None = None
    tier0_bytes: dict[str, int] | None = None
    """With tier 0, once the epoch is committed in memory: worker address -> bytes of snapshots held."""


OnMemoryCommit = Callable[[int, dict[str, int]], None]
"""Told of each epoch the pipeline commits in cluster memory: ``(epoch, tier0_bytes)`` (worker
address -> bytes of tier-0 snapshots it holds)."""
