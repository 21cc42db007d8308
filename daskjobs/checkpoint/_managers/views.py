"""Read-only inspection of committed checkpoints, without a session."""

from __future__ import annotations

import html
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ...errors import BlobTypeError, CheckpointNotFoundError, JobDefinitionError
from .._format.records import committed_entry, record_bytes, record_summaries
from .._protocol.retention import best_epochs
from .._protocol.store import CheckpointStore
from .._storage.reader import GroupReader

if TYPE_CHECKING:
    from ..._model.values import Value
    from .._format.documents import BlobMeta, CommitRecord, CommittedEntry

logger = logging.getLogger("daskjobs")


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed epoch: what :func:`~daskjobs.list_checkpoints` returns."""

    epoch: int
    job: str
    nodes: list[str]
    nbytes: int
    created: str
    stop_values: dict[str, bool]
    record: CommitRecord = field(repr=False)
    """The whole commit record."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The epoch's metric means (logged with ``ws.log``), from the commit record."""

    def __getitem__(self, key: str) -> Any:
        """Dict-style access: ``info["epoch"]`` is ``info.epoch``; other keys come from the commit
        record (``info["timings"]``, ``info["format_version"]`` …).

        Examples
        --------
        >>> info = CheckpointInfo(3, "job", ["a"], 8, "", {}, {"timings": {"save_seconds": 0.5}})
        >>> info["epoch"], info["timings"]
        (3, {'save_seconds': 0.5})
        """
        if key in self.__dataclass_fields__:
            return getattr(self, key)
        record: Mapping[str, Any] = self.record
        return record[key]


def list_checkpoints(db_prefix: str, storage_options: dict[str, Any] | None = None) -> list[CheckpointInfo]:
    """The committed epochs under ``db_prefix``, oldest first, with their commit metadata.

    An epoch whose commit record cannot be read (corrupt, truncated, not a regular file) is left
    out with a logged warning naming it; ``CheckpointStore(db_prefix).scan_commits()`` lists it
    with its error.

    Examples
    --------
    >>> import tempfile
    >>> list_checkpoints(tempfile.mkdtemp())
    []
    """
    store = CheckpointStore(db_prefix, storage_options)
    infos = []
    for epoch, record in store.scan_commits():
        if isinstance(record, Exception):
            logger.warning("skipping epoch %d under %s: %s", epoch, store.url, record)
        else:
            infos.append(_info(record))
    return infos


def _info(record: CommitRecord) -> CheckpointInfo:
    return CheckpointInfo(
        record["epoch"],
        record["job"],
        list(record["nodes"]),
        record_bytes(record)[0],
        record.get("created", ""),
        dict(record.get("stop_values", {})),
        record,
        dict(record.get("metrics", {})),
    )


class NodeCheckpoint(Mapping[str, Any]):
    """One node's blobs in a committed epoch; indexing reads and verifies a blob.

    A blob is a numpy array or, for JSON blobs, the JSON value. The node's entry comes from a
    commit record the store validated (from format version 4 on, the node's manifest, read once here
    and verified against the record); each access reads and verifies only that blob.
    """

    def __init__(self, store: CheckpointStore, node: str, epoch: int, entry: CommittedEntry) -> None:
        self._store, self.node, self.epoch = store, node, epoch
        self._reader: GroupReader = store.reader(node, epoch, entry, entry_validated=True)
        self._entry = self._reader.entry

    def _meta(self, blob: str) -> BlobMeta:
        meta = self._entry["blobs"].get(blob)
        if meta is None:
            self._reader.check_group()  # a blob removed from the commit record is corruption, not a missing key
            raise KeyError(f"node {self.node!r} has no blob {blob!r} in epoch {self.epoch}; it has {sorted(self)}")
        return meta

    def __getitem__(self, blob: str) -> Any:
        self._meta(blob)
        return self._reader.read([blob])[blob]

    def read(self, blobs: list[str] | None = None) -> dict[str, Value]:
        """Read and verify several blobs at once (default: all); faster than one by one."""
        for blob in blobs or []:
            self._meta(blob)
        return self._reader.read(blobs)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entry["blobs"]))

    def __len__(self) -> int:
        return len(self._entry["blobs"])

    def blobs(self) -> dict[str, BlobMeta]:
        """Every blob's entry (kind, dtype, shape, chunks, nbytes …), verified, by name; nothing is read."""
        return {name: meta.copy() for name, meta in self._entry["blobs"].items()}

    def lazy(self, blob: str) -> Any:
        """A lazy ``dask.array`` of an array blob, one task per stored chunk.

        Each task reads its chunk file (a regular file, bounded by its recorded size), checks the
        array's metadata and the chunk's XXH3-128 digest against the commit record, and raises
        :class:`~daskjobs.errors.CheckpointCorruptError` naming epoch, node, blob and chunk on
        any mismatch. Nothing unverified is ever returned.

        Raises
        ------
        TypeError
            The blob is a JSON value (read it with ``view[node][blob]``).
        """
        import dask.array as da

        meta = self._meta(blob)
        if meta["kind"] != "array":
            raise BlobTypeError(
                f"blob {blob!r} of node {self.node!r} is a JSON value, not an array: use view[node][blob]"
            )
        shape, dtype = tuple(meta["shape"]), np.dtype(meta["dtype"]).newbyteorder("=")
        if not shape:
            return da.from_delayed(_delayed(self._reader.read_chunk, blob, 0), shape=(), dtype=dtype)
        if 0 in shape:  # no chunk to read: one task still checks the group and the array's metadata
            return da.from_delayed(_delayed(self._reader.read_blob, blob), shape=shape, dtype=dtype)
        rows = meta["chunks"][0]
        count = -(-shape[0] // rows)
        name = f"daskjobs-{self.node}.{self.epoch}-{blob}-{self._entry['save_id']}"
        tail = (0,) * (len(shape) - 1)
        graph = {(name, i, *tail): (self._reader.read_chunk, blob, i) for i in range(count)}
        sizes = tuple(min(rows, shape[0] - i * rows) for i in range(count))
        return da.Array(graph, name, (sizes, *((d,) for d in shape[1:])), dtype=dtype)

    def __repr__(self) -> str:
        return f"NodeCheckpoint(node={self.node!r}, epoch={self.epoch}, blobs={sorted(self)})"


def _delayed(read: Any, *args: Any) -> Any:
    """A dask task calling ``read(*args)`` (a verifying read of a :class:`GroupReader`)."""
    from dask.delayed import delayed

    return delayed(read, pure=True)(*args)


class CheckpointView(Mapping[str, NodeCheckpoint]):
    """A committed epoch: ``view[node][blob]`` is a verified numpy array.

    Attributes
    ----------
    epoch : int
    nodes : list of str
    job : str
    record : dict
        The commit record, as the store's ``read_commit`` returned it (validated there).
    """

    def __init__(self, store: CheckpointStore, record: CommitRecord) -> None:
        self._store = store
        self.record = record
        self.epoch: int = record["epoch"]
        self.job: str = record["job"]
        self.nodes: list[str] = list(record["nodes"])
        self._node_views: dict[str, NodeCheckpoint] = {}

    def __getitem__(self, node: str) -> NodeCheckpoint:
        if node not in self.nodes:
            raise KeyError(f"epoch {self.epoch} has no node {node!r}; it has {self.nodes}")
        if node not in self._node_views:  # built once, then indexed: linear cost in blobs
            entry = committed_entry(self.record, node)
            self._node_views[node] = NodeCheckpoint(self._store, node, self.epoch, entry)
        return self._node_views[node]

    def __iter__(self) -> Iterator[str]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def verify(self) -> int:
        """Read and verify every blob of every node; return the number of bytes checked."""
        checked = 0
        for node in self.nodes:
            self._store.read_node(node, self.epoch, committed_entry(self.record, node), entry_validated=True)
            checked += record_summaries(self.record)[node]["bytes"]
        return checked

    def __repr__(self) -> str:
        return f"CheckpointView(job={self.job!r}, epoch={self.epoch}, nodes={self.nodes})"

    def _repr_html_(self) -> str:
        rows = "".join(
            f"<tr><td>{html.escape(node)}</td><td>{html.escape(name)}</td><td>{_kind_text(meta)}</td>"
            f"<td>{'' if meta.get('kind') == 'json' else tuple(meta['shape'])}</td><td>{meta['nbytes']}</td></tr>"
            for node in self.nodes
            for name, meta in sorted(self[node].blobs().items())
        )
        nbytes = record_bytes(self.record)[0]
        facts = [f"{nbytes} bytes", f"committed {html.escape(str(self.record.get('created', '?')))}"]
        facts += [f"{html.escape(k)}={v:.6g}" for k, v in self.record.get("metrics", {}).items()]
        facts += [f"{html.escape(k)}={v}" for k, v in self.record.get("stop_values", {}).items()]
        return (
            f"<b>Checkpoint</b> of job {html.escape(self.job)}, epoch {self.epoch} "
            f"<code>{html.escape(self._store.url)}</code> ({', '.join(facts)})"
            "<table><tr><th>node</th><th>blob</th><th>dtype</th><th>shape</th><th>bytes</th></tr>"
            f"{rows}</table>"
        )


def _kind_text(meta: BlobMeta) -> str:
    """``float32`` for an array stored as ``<f4``, ``JSON`` for a JSON value; unknown dtypes as recorded."""
    if meta.get("kind") == "json":
        return "JSON"
    try:
        return html.escape(str(np.dtype(meta["dtype"])))
    except TypeError:
        return html.escape(str(meta["dtype"]))


def open_checkpoint(
    db_prefix: str,
    epoch: int | Literal["best"] | None = None,
    storage_options: dict[str, Any] | None = None,
    *,
    metric: str | None = None,
    mode: Literal["min", "max"] | None = None,
) -> CheckpointView:
    """A read-only view of committed ``epoch`` (default: the latest) under ``db_prefix``.

    Works while a runner holds the prefix's writer lock.

    Parameters
    ----------
    db_prefix
        A local path or an fsspec URL.
    epoch
        A committed epoch, ``None`` for the latest, or ``"best"``: the committed epoch with the
        best value of ``metric`` (ties: the earlier epoch).
    storage_options
        Passed to fsspec.
    metric, mode
        Used with ``epoch="best"``. Default: the ``best_metric``/``best_mode`` the latest commit was
        made with (a manager with ``keep_best``), else ``"loss"`` and ``"min"``.

    Raises
    ------
    CheckpointNotFoundError
        No such committed epoch (or none at all), or with ``"best"`` no committed epoch has ``metric``.

    Examples
    --------
    >>> import tempfile
    >>> open_checkpoint(tempfile.mkdtemp(), "best")
    Traceback (most recent call last):
    ...
    daskjobs.errors.CheckpointNotFoundError: no committed checkpoint under ...
    """
    store = CheckpointStore(db_prefix, storage_options)
    if epoch is None or epoch == "best":
        record = store.latest_commit()
        if record is None:
            raise CheckpointNotFoundError(f"no committed checkpoint under {store.url}")
        if epoch == "best":
            return CheckpointView(store, _best_record(store, record, metric, mode))
        return CheckpointView(store, record)
    if isinstance(epoch, str):
        raise JobDefinitionError(f"epoch must be an int, None or 'best', got {epoch!r}")
    return CheckpointView(store, store.read_commit(epoch))


def _best_record(store: CheckpointStore, latest: CommitRecord, metric: str | None, mode: str | None) -> CommitRecord:
    recorded: Mapping[str, Any] = latest.get("best") or {}  # not validated: daskjobs' own (sealed) record
    if metric is None:
        metric = recorded.get("metric", "loss")
    if mode is None:
        mode = recorded.get("mode", "min") if recorded.get("metric") == metric else "min"
    if mode not in ("min", "max"):
        raise JobDefinitionError(f"mode must be 'min' or 'max', got {mode!r}")
    records = {e: store.read_commit(e) for e in store.committed_epochs()}
    ranked = best_epochs({e: r.get("metrics", {}).get(metric) for e, r in records.items()}, mode)
    if not ranked:
        raise CheckpointNotFoundError(
            f"no committed epoch under {store.url} has metric {metric!r} (committed epochs: {sorted(records)}); "
            "log it with ws.log(name, value), or pass metric= the name of a logged metric"
        )
    return records[ranked[0]]


def prefix_html(title: str, store: CheckpointStore, options: Mapping[str, Any]) -> str:
    """HTML of a checkpoint prefix for notebooks: ``title``, the options that are set, the committed
    epochs and the latest one's metrics."""
    epochs = store.committed_epochs()
    facts = "".join(f", {k}={html.escape(str(v))}" for k, v in options.items() if v)
    latest = ""
    if epochs:
        metrics = store.read_commit(epochs[-1]).get("metrics", {})
        shown = "".join(f" {html.escape(k)}={v:.6g}" for k, v in metrics.items())
        listed = ", ".join(map(str, epochs)) if len(epochs) <= 12 else f"{epochs[0]} &hellip; {epochs[-1]}"
        latest = f" ({listed}); latest {epochs[-1]}{shown}"
    return f"<b>{title}</b> <code>{html.escape(store.url)}</code>{facts}: {len(epochs)} committed epochs{latest}"
