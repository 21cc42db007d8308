"""What a node's checkpoint hooks return to the driver (``finish`` hooks, see
:meth:`~daskjobs.Session.run_group`): the outcome of a save, of a background flush, of an
asynchronous save, of a probe of the prefix. They never raise: an error travels back as a value, for the driver's retry
policy. Frozen, small (a node's entry is reported, never its blobs) and picklable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .._format.documents import EntryReport


@dataclass(frozen=True)
class FlushReport:
    """How a node's background flush of its save ``save_id`` ended: ``error`` ``None`` once its group
    is durable; ``entry``: what the background write returned (a small workspace written whole
    there, see ``SaveFinish``), else ``None``."""

    save_id: str
    error: BaseException | None = None
    entry: EntryReport | None = None


@dataclass(frozen=True)
class SaveOutcome:
    """A node's save: the entry it wrote (as reported), or the error that stopped it.

    A save at the end of an epoch's graph (``SaveFinish``) also says whether its group is flushed
    ``later``, in the background, and reports the node's previous background flush (``flushed``,
    ``None``: there was none).
    """

    entry: EntryReport | None = None
    error: BaseException | None = None
    later: bool = False
    flushed: FlushReport | None = None


@dataclass(frozen=True)
class FlushOutcome:
    """What waiting for a node's background flush found (``FlushFinish``): its report, ``None`` when
    the node had no flush pending."""

    flushed: FlushReport | None


@dataclass(frozen=True)
class AsyncSaveOutcome:
    """An epoch's asynchronous save hook (``AsyncSaveFinish``): how the save in flight, of the epoch
    before, ended on the node (``None``: there was none), and the error that kept this epoch's save
    from starting, if any."""

    previous: SaveOutcome | None
    error: BaseException | None = None


@dataclass(frozen=True)
class ProbeReport:
    """What a node's probe of the prefix found (``ProbeFinish``): where the node runs, and why it did
    not see the driver's probe file (``unseen``), why it could not write its own (``unwritable``),
    or that it ``wrote`` it; ``unread``: why the driver did not read back what the node wrote (the
    driver's own finding)."""

    where: str
    unseen: str | None = None
    unwritable: str | None = None
    wrote: bool = False
    unread: str | None = None
