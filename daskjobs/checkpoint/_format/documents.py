"""The JSON documents of a checkpoint as types: a node's entry (what its manifest holds), the summary
a commit record keeps of it, what a node reports of it to the driver, and the commit record (pure:
no I/O).

They describe JSON daskjobs built itself or read back and validated (:func:`.entries.validate_node_entry`,
:func:`.records.validate_commit_record`): at run time they are plain dicts, for a type checker they
name their keys. A document read back is only ever one of these after it validated.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict, final


class ManifestRef(TypedDict):
    """A node's manifest (its group's ``zarr.json``) as a commit record names it: size and XXH3-128 digest."""

    size: int
    xxh3: str


class BlobLayout(TypedDict):
    """How one blob is stored: what its array metadata (``zarr.json``) follows from."""

    kind: str
    """``"array"`` or ``"json"`` (a 1-d ``uint8`` array of UTF-8 JSON text)."""
    dtype: str
    shape: list[int]
    nbytes: int
    chunks: list[int]
    codec: str | None
    dimension_names: NotRequired[list[str]]
    """Absent in entries written before daskjobs named an array's dimensions."""


class BlobMeta(BlobLayout):
    """One blob of a node entry: its layout and the XXH3-128 digest of every chunk file."""

    hashes: list[str]
    sizes: NotRequired[list[int]]
    """The stored size of every chunk file (compressed blobs only)."""


class Totals(TypedDict):
    """What every description of a node's save holds: its save id, sizes and duration."""

    save_id: str
    bytes: int
    bytes_written: int
    bytes_reused: int
    seconds: float


@final
class NodeEntry(Totals):
    """A node's whole entry: what its manifest holds, with its reference once written (a write
    returns it; an entry only described, see ``describe_group``, has none)."""

    node: str
    epoch: int
    blobs: dict[str, BlobMeta]
    manifest: NotRequired[ManifestRef]


@final
class EntrySummary(Totals):
    """What a commit record (format version 4 on) keeps of a node's entry: totals and its manifest."""

    manifest: ManifestRef


@final
class EntryReport(Totals):
    """What a node tells the driver of an entry it wrote, and what a save is told of the entry it
    reuses chunks from: never its blobs. ``manifest`` is ``None`` for an entry described before
    its group was written (see ``SaveFinish``)."""

    node: str
    epoch: int
    manifest: ManifestRef | None


CommittedEntry = NodeEntry | EntrySummary
"""What a commit record holds of a node: its summary naming its manifest (format version 4 on), or
its whole entry (before)."""

PreviousEntry = NodeEntry | EntryReport
"""What a node's save reuses chunks from (delta): the newest earlier save of the node, naming its node
and epoch: its whole entry (a commit record before format version 4), or its summary."""

EntryRef = NodeEntry | EntrySummary | EntryReport
"""What names one node's save: its whole entry, or a summary naming its manifest (a commit record's,
or as a node reported it). ``"blobs" in entry`` tells a whole entry from the others."""


class BestMetric(TypedDict):
    """The best-k metric and mode a commit was made with (``keep_best``)."""

    metric: str
    mode: str


class CommitRecord(TypedDict):
    """A commit record (see :mod:`.records`), without its seal: ``manifests`` from format version 4
    on, ``node_entries`` (every node's whole entry) before."""

    format: str
    format_version: int
    daskjobs_version: str
    created: str
    job: str
    epoch: int
    nodes: list[str]
    manifests: NotRequired[dict[str, EntrySummary]]
    node_entries: NotRequired[dict[str, NodeEntry]]
    stop_values: dict[str, bool]
    timings: dict[str, float]
    metrics: dict[str, float]
    best: NotRequired[BestMetric]
