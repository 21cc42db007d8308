"""The last checkpoint a manager saved or loaded (its blob names, the durations to report, the commit
record a save reuses chunks from)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ...errors import InvalidStateError
from .._format.naming import db_name

if TYPE_CHECKING:
    from .._format.documents import CommitRecord, EntryRef
    from .._protocol.store import CheckpointStore


class LastCheckpoint:
    """The last checkpoint a manager saved or loaded: where it is and its nodes' entries (or their
    summaries; blob names are read only when asked), the durations to report, and the commit record
    a save reuses chunks from (delta) without reading it again."""

    def __init__(self) -> None:
        self.found: tuple[CheckpointStore, int, dict[str, EntryRef]] | None = None
        self.stats: dict[str, int] = {}
        """Nanoseconds by checkpoint name (``<db_prefix>/<node>.<epoch>``), for the metadata handler."""
        self.record: CommitRecord | None = None
        """The commit record saved or loaded last through the manager's own store."""

    def remember(self, store: CheckpointStore, epoch: int, entries: Mapping[str, EntryRef], prefix: str) -> None:
        """Keep the durations of the node ``entries`` of ``epoch`` just saved or loaded from ``store``,
        and where their blob names are (``prefix``: the manager's ``db_prefix``)."""
        self.found = (store, epoch, dict(entries))
        folder = db_name(epoch, next(iter(entries), "n"), prefix).rsplit("/", 1)[0]  # the names were validated
        self.stats = {f"{folder}/{n}.{epoch}": int(e.get("seconds", 0) * 1e9) for n, e in entries.items()}

    def blob_list(self) -> dict[str, list[str]]:
        """Blob names per node of the last checkpoint (from its nodes' manifests)."""
        if self.found is None:
            raise InvalidStateError("no checkpoint saved or loaded yet by this manager")
        store, epoch, entries = self.found
        return {n: sorted(store.resolve_entry(n, epoch, e)["blobs"]) for n, e in entries.items()}
