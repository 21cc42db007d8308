"""Comparing every committed epoch of a run with reference A: chunk digests first, blobs only where
they differ, then the stop values and metrics of the commit records."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..checkpoint import CheckpointStore
from ._report import KINDS, Divergence, Kind

if TYPE_CHECKING:
    from ..checkpoint._format.documents import NodeEntry

_LAYOUT = ("kind", "dtype", "shape", "chunks", "codec", "hashes")
"""What makes two blob entries store the very same bytes (the digest of every chunk included)."""
_SHOWN = 60
"""Characters of a JSON value a divergence's detail shows."""


def compare_runs(
    reference: CheckpointStore,
    run: CheckpointStore,
    name: str,
    unreproducible: Collection[tuple[int, str | None, str | None]] = (),
) -> list[Divergence]:
    """Every difference of run ``name`` (its checkpoints in ``run``) from ``reference``, in every
    committed epoch of either. The divergences of the second reference ``"B"`` are all
    ``"nondeterministic"``, and so is a divergence of another run at an ``(epoch, node, blob)``
    in ``unreproducible`` (where B differs too: a resume does not explain it)."""
    ours, theirs = reference.committed_epochs(), run.committed_epochs()
    found = _Found(name, unreproducible)
    for epoch in sorted(set(ours) | set(theirs)):
        if epoch not in theirs:
            found.add(epoch, None, None, "missing", f"epoch {epoch} is committed in reference A, not in run {name}")
        elif epoch not in ours:
            found.add(epoch, None, None, "extra", f"run {name} committed epoch {epoch}, reference A did not")
        else:
            _compare_epoch(reference, run, epoch, found)
    return found.divergences


def ordering(runs: list[str]) -> Callable[[Divergence], tuple[Any, ...]]:
    """The sort key of divergences: earliest epoch first; then kind (nondeterminism first), the run
    (in the order of ``runs``), whole epochs and nodes before blobs, blobs before stop values and
    metrics, node, blob."""
    position = {run: i for i, run in enumerate(runs)}

    def key(divergence: Divergence) -> tuple[Any, ...]:
        if divergence.kind == "metric":
            category = 3
        elif divergence.blob is None:
            category = 0
        else:
            category = 2 if divergence.node is None else 1
        return (
            divergence.epoch,
            KINDS.index(divergence.kind),
            position.get(divergence.run, len(position)),
            category,
            divergence.node or "",
            divergence.blob or "",
        )

    return key


class _Found:
    """The divergences of one run, with the kind each gets (see :func:`compare_runs`)."""

    def __init__(self, run: str, unreproducible: Collection[tuple[int, str | None, str | None]]) -> None:
        self.run, self.unreproducible = run, unreproducible
        self.divergences: list[Divergence] = []

    def add(self, epoch: int, node: str | None, blob: str | None, kind: Kind, detail: str) -> None:
        if self.run == "B" or (epoch, node, blob) in self.unreproducible:
            kind = "nondeterministic"
        self.divergences.append(Divergence(epoch, node, blob, self.run, kind, detail))


def _compare_epoch(reference: CheckpointStore, run: CheckpointStore, epoch: int, found: _Found) -> None:
    ours, theirs = reference.read_commit(epoch), run.read_commit(epoch)
    a_entries, b_entries = reference.node_entries(epoch, ours), run.node_entries(epoch, theirs)
    for node in sorted(set(a_entries) | set(b_entries)):
        if node not in b_entries:
            found.add(epoch, node, None, "missing", f"node {node!r} is checkpointed in reference A, not in run")
        elif node not in a_entries:
            found.add(epoch, node, None, "extra", f"node {node!r} is checkpointed in the run, not in reference A")
        else:
            _compare_node(reference, run, epoch, node, (a_entries[node], b_entries[node]), found)
    a_stop, b_stop = ours.get("stop_values", {}), theirs.get("stop_values", {})
    for name in sorted(set(a_stop) | set(b_stop)):
        if a_stop.get(name) != b_stop.get(name):
            found.add(
                epoch, None, name, "resume", f"stop condition {name!r}: A {a_stop.get(name)}, run {b_stop.get(name)}"
            )
    a_metrics, b_metrics = ours.get("metrics", {}), theirs.get("metrics", {})
    for name in sorted(set(a_metrics) | set(b_metrics)):
        a, b = a_metrics.get(name), b_metrics.get(name)
        if a != b:
            if a is None or b is None:
                detail = f"logged only in {'the run' if a is None else 'reference A'} ({a if b is None else b!r})"
            else:
                detail = f"A {a!r}, run {b!r} (absolute difference {abs(a - b):.6g})"
            found.add(epoch, None, name, "metric", detail)


def _compare_node(
    reference: CheckpointStore,
    run: CheckpointStore,
    epoch: int,
    node: str,
    entries: tuple[NodeEntry, NodeEntry],
    found: _Found,
) -> None:
    a_blobs, b_blobs = entries[0]["blobs"], entries[1]["blobs"]
    for blob in sorted(set(a_blobs) - set(b_blobs)):
        found.add(epoch, node, blob, "missing", f"blob {blob!r} of reference A is absent from the run")
    for blob in sorted(set(b_blobs) - set(a_blobs)):
        found.add(
            epoch, node, blob, "extra", f"the run has blob {blob!r}, reference A does not ({_kind(b_blobs[blob])})"
        )
    differing = [
        blob
        for blob in sorted(set(a_blobs) & set(b_blobs))
        if any(a_blobs[blob].get(key) != b_blobs[blob].get(key) for key in _LAYOUT)
    ]
    if not differing:
        return
    a_values = reference.read_node(node, epoch, entries[0], differing, entry_validated=True)
    b_values = run.read_node(node, epoch, entries[1], differing, entry_validated=True)
    for blob in differing:
        detail = difference(a_values[blob], b_values[blob])
        if detail is not None:
            found.add(epoch, node, blob, "resume", detail)


def _kind(meta: Mapping[str, Any]) -> str:
    if meta.get("kind") == "json":
        return "a JSON value"
    return f"{np.dtype(meta['dtype']).newbyteorder('=')} {tuple(meta['shape'])}"


def difference(a: Any, b: Any) -> str | None:
    """How blob value ``b`` differs from reference value ``a`` (``None``: equal).

    Arrays are equal when dtype, shape and bytes are; JSON values when they are equal. For numeric
    arrays of one shape the detail gives the largest absolute difference and where it is.

    Examples
    --------
    >>> difference(np.arange(3.0), np.array([0.0, 1.5, 2.0]))
    'float64 (3,): 1 of 3 elements differ; largest absolute difference 0.5 at [1] (A 1.0, run 1.5)'
    >>> difference({"n": 1}, {"n": 1}) is None, difference([1, 2], [1, 3])
    (True, 'JSON values differ: A [1, 2], run [1, 3]')
    """
    a_array, b_array = isinstance(a, np.ndarray), isinstance(b, np.ndarray)
    if not a_array and not b_array:
        return None if a == b else f"JSON values differ: A {_short(a)}, run {_short(b)}"
    if a_array != b_array:
        return f"A holds {_what(a)}, the run {_what(b)}"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"A holds {_what(a)}, the run {_what(b)}"
    if a.tobytes() == b.tobytes():
        return None
    head = f"{a.dtype} {a.shape}"
    if a.dtype.kind in "US":
        unequal = a != b
        return f"{head}: {int(np.count_nonzero(unequal))} of {a.size} elements differ"
    differs = a != b
    if a.dtype.kind in "fc":  # bytes may differ where values compare equal (0.0 and -0.0) or not at all (NaN)
        differs = differs | (np.signbit(a.real) != np.signbit(b.real)) | (np.isnan(a) != np.isnan(b))
    count = int(np.count_nonzero(differs))
    if a.dtype.kind == "b":
        return f"{head}: {count} of {a.size} elements differ"
    wide = np.complex128 if a.dtype.kind == "c" else np.float64
    gaps = np.abs(a.astype(wide) - b.astype(wide)).reshape(a.shape)
    gaps = np.where(np.isnan(gaps), np.inf, gaps) if np.isnan(gaps).any() else gaps
    index = np.unravel_index(int(np.argmax(gaps)), a.shape) if a.shape else ()
    at = f" at {list(map(int, index))}" if a.shape else ""
    largest = float(gaps[index]) if a.shape else float(gaps)
    return (
        f"{head}: {count} of {a.size} elements differ; largest absolute difference {largest:.6g}{at} "
        f"(A {_item(a, index)}, run {_item(b, index)})"
    )


def _item(array: np.ndarray, index: tuple[Any, ...]) -> str:
    value = array[index] if array.shape else array[()]
    return repr(value.item())


def _what(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of {value.dtype} {value.shape}"
    return f"the JSON value {_short(value)}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[: _SHOWN - 3]}..."
