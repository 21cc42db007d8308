"""ArrayReader: minibatches of rows of numpy or Zarr arrays, shuffled per pass, sharded, resumable."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._model.values import check_count
from ..errors import InvalidStateError, JobDefinitionError
from ._reader import Reader
from ._sources import ZarrSource, as_source

if TYPE_CHECKING:
    from .._model.workspace import Workspace


def _positive_int(value: object, what: str, reader: str, minimum: int = 1) -> int:
    return check_count(value, f"reader {reader!r}: {what}", minimum)


@dataclass(frozen=True)
class _Claim:
    """One batch: its pass and the range of positions in that pass's record order."""

    pass_: int
    start: int
    stop: int


@dataclass(frozen=True)
class _ArraySetup:
    """The init step: carries the numpy sources to the node once; epoch tasks carry none."""

    reader: ArrayReader
    arrays: tuple[np.ndarray | None, ...]

    def __call__(self, ws: Workspace) -> None:
        self.reader._install(ws, self.arrays)


class ArrayReader(Reader):
    """Minibatches of the rows of equally long arrays, resumable from any committed epoch.

    Each record is one row of every source; a batch is a tuple with one array per source (just
    the array for a single source). Numpy sources travel to the node once, with the init task,
    and live there as blobs ``reader.<name>.source.<i>`` (checkpointed like the model; delta
    checkpoints reuse their unchanged chunks), so epochs and restores never send them again.
    Zarr sources are read on the node, slice by slice: the data never passes through the client.
    The position is the blob ``reader.<name>.position`` (``[pass, records read in the pass]``).

    Parameters
    ----------
    *sources
        Numpy arrays, ``zarr.Array`` objects, or URLs/paths of Zarr arrays, all with the same
        number of rows.
    batch_size
        Records per batch.
    shuffle
        Visit the records of each pass in a fresh order, a pure function of ``(seed, pass)``.
    seed
        Seed of the shuffle.
    num_passes
        Passes over the data before the reader is exhausted; ``None`` never ends.
    shard
        ``(index, count)``: read only records ``index, index + count, ...``.
    drop_last
        Skip a pass's last batch when it is smaller than ``batch_size``.
    name
        Names the reader's blobs (see :class:`Reader`).
    storage_options
        fsspec options for Zarr URLs (e.g. S3 credentials), used on the node.

    Raises
    ------
    JobDefinitionError
        A ``ValueError`` naming the reader: sources of different lengths, a bad ``batch_size``,
        ``shard``, ``seed`` or ``num_passes``, a shard without a batch when ``num_passes`` is ``None``
        (with finite passes such a reader is exhausted at once: it reads nothing). A Zarr URL that is
        missing or not an array fails the init group, naming the reader, before any epoch runs.

    Examples
    --------
    >>> import numpy as np
    >>> import daskjobs as dj
    >>> with dj.Cluster(), dj.Job() as job:
    ...     with job.init_group:
    ...         reader = dj.ArrayReader(np.arange(10), batch_size=4, name="ids")
    ...         _ = dj.Task(lambda ws: ws.__setitem__("sums", np.zeros(0, dtype=np.int64)))
    ...     limited = dj.ReaderWithLimit(reader)
    ...     _ = dj.pipe(limited, lambda ws, batch: ws.__setitem__("sums", np.append(ws["sums"], batch.sum())))
    ...     _ = job.add_stop_condition(limited.data_finished())
    >>> with dj.LocalSession() as session:
    ...     dj.JobRunner(job, progress=False).train(session), session.fetch("sums")
    (1, array([ 6, 22, 17]))
    """

    def __init__(
        self,
        *sources: Any,
        batch_size: int,
        shuffle: bool = False,
        seed: int = 0,
        num_passes: int | None = 1,
        shard: tuple[int, int] | None = None,
        drop_last: bool = False,
        name: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        label = self._label(name)
        if not sources:
            raise JobDefinitionError(f"reader {label!r}: ArrayReader needs at least one source")
        self.batch_size = _positive_int(batch_size, "batch_size", label)
        self.seed = _positive_int(seed, "seed", label, minimum=0)
        self.num_passes = None if num_passes is None else _positive_int(num_passes, "num_passes", label)
        if shard is None:
            shard = (0, 1)
        if (
            not isinstance(shard, tuple | list)
            or len(shard) != 2
            or any(isinstance(v, bool) or not isinstance(v, int | np.integer) for v in shard)
            or not 0 <= shard[0] < shard[1]
        ):
            raise JobDefinitionError(
                f"reader {label!r}: shard must be (index, count) with 0 <= index < count, got {shard!r}"
            )
        self.shard = (int(shard[0]), int(shard[1]))
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        if storage_options is not None and not isinstance(storage_options, Mapping):
            raise JobDefinitionError(f"reader {label!r}: storage_options must be a dict, got {storage_options!r}")
        normalised = [as_source(s, label, i, storage_options) for i, s in enumerate(sources)]
        self._zarr = tuple(s if isinstance(s, ZarrSource) else None for s in normalised)
        self._arrays: tuple[np.ndarray | None, ...] | None = tuple(
            s if isinstance(s, np.ndarray) else None for s in normalised
        )
        lengths = {i: self._known_length(i) for i in range(len(sources))}
        self._check_lengths({i: n for i, n in lengths.items() if n is not None}, label)
        self._opened: dict[int, Any] = {}
        self._order_cache: tuple[int, np.ndarray] | None = None
        self._cache_lock = threading.Lock()
        super().__init__(name)

    # -- construction helpers ------------------------------------------------------------------
    def _known_length(self, index: int) -> int | None:
        array = None if self._arrays is None else self._arrays[index]
        if array is not None:
            return len(array)
        target = self._zarr_source(index).target
        return None if isinstance(target, str) else int(target.shape[0])

    def _zarr_source(self, index: int) -> ZarrSource:
        source = self._zarr[index]
        if source is None:
            raise InvalidStateError(f"reader {self.name!r}: source {index} is an array, not a Zarr array")
        return source

    def _check_lengths(self, lengths: dict[int, int], label: str) -> None:
        if len(set(lengths.values())) > 1:
            raise JobDefinitionError(
                f"reader {label!r}: sources have different lengths {lengths} (source index: rows); "
                "every source needs one row per record"
            )
        if lengths:
            self._check_batches(next(iter(lengths.values())), label)

    def _check_batches(self, records: int, label: str) -> None:
        if self.batches_per_pass(records) == 0 and self.num_passes is None:
            index, count = self.shard
            raise JobDefinitionError(
                f"reader {label!r}: shard {index} of {count} of {records} records holds "
                f"{self._shard_size(records)} records: not one batch of {self.batch_size}"
                f"{' (drop_last=True)' if self.drop_last else ''}, and num_passes=None would read it forever"
            )

    def _shard_size(self, records: int) -> int:
        index, count = self.shard
        return len(range(index, records, count))

    def batches_per_pass(self, records: int) -> int:
        """Batches in one pass over ``records`` rows (after sharding)."""
        size = self._shard_size(records)
        return size // self.batch_size if self.drop_last else -(-size // self.batch_size)

    def total_batches(self) -> int | None:
        """Batches over all passes, when the client knows the length (numpy sources or a
        ``zarr.Array``) and ``num_passes`` is finite; else ``None``."""
        lengths = [n for n in (self._known_length(i) for i in range(len(self._zarr))) if n is not None]
        if not lengths or self.num_passes is None:
            return None
        return self.batches_per_pass(lengths[0]) * self.num_passes

    def _init_step(self) -> _ArraySetup:
        return _ArraySetup(self, self._arrays or ())

    def __getstate__(self) -> dict[str, Any]:
        # Epoch tasks carry the reader: never its data (that went to the node with the init task).
        state = dict(self.__dict__)
        state.update(_arrays=None, _opened={}, _order_cache=None, _cache_lock=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._cache_lock = threading.Lock()

    # -- on the node ---------------------------------------------------------------------------
    def setup(self, ws: Workspace) -> None:
        """Create the position blob and put the numpy sources on the node (the init task)."""
        if self._arrays is None:
            raise JobDefinitionError(f"reader {self.name!r}: setup runs in its init task, which carries the data")
        self._install(ws, self._arrays)

    def _install(self, ws: Workspace, arrays: tuple[np.ndarray | None, ...]) -> None:
        self._check_ws(ws)
        lengths = {i: len(a) for i, a in enumerate(arrays) if a is not None}
        for i, source in enumerate(self._zarr):
            if source is not None:
                lengths[i] = int(self._source(i).shape[0])
        self._check_lengths(lengths, self.name)
        for i, array in enumerate(arrays):
            if array is not None:
                ws[self.blob(f"source.{i}")] = np.array(array, copy=True)
        ws[self.blob("position")] = np.zeros(2, dtype=np.int64)

    def _source(self, index: int) -> Any:
        opened = self._opened.get(index)
        if opened is None:
            opened = self._opened[index] = self._zarr_source(index).open(self.name, self.node)
        return opened

    def _records(self, ws: Workspace) -> int:
        if self._zarr[0] is not None:
            return int(self._source(0).shape[0])
        return len(self._state(ws, "source.0"))

    def _order(self, pass_: int, records: int) -> np.ndarray:
        """Record indices of one pass, in reading order (cached for the current pass)."""
        with self._cache_lock:
            cached = self._order_cache
            if cached is not None and cached[0] == pass_ and len(cached[1]) == self._shard_size(records):
                return cached[1]
            index, count = self.shard
            order = np.arange(index, records, count)
            if self.shuffle:
                order = order[np.random.default_rng([self.seed, pass_]).permutation(len(order))]
            self._order_cache = (pass_, order)
            return order

    def exhausted(self, ws: Workspace) -> bool:
        """Whether all ``num_passes`` passes have been read."""
        position = self._state(ws, "position")
        return self.num_passes is not None and int(position[0]) >= self.num_passes

    def _claim(self, ws: Workspace) -> _Claim | None:
        position = self._state(ws, "position")
        pass_, offset = int(position[0]), int(position[1])
        if self.num_passes is not None and pass_ >= self.num_passes:
            return None
        records = self._records(ws)
        size = self._shard_size(records)
        usable = size - size % self.batch_size if self.drop_last else size
        if usable == 0 and offset == 0 and self.num_passes is not None:  # not one batch: exhausted at once
            ws[self.blob("position")] = np.array([self.num_passes, 0], dtype=np.int64)
            return None
        stop = min(offset + self.batch_size, usable)
        if stop <= offset:
            raise JobDefinitionError(
                f"reader {self.name!r}: its position {position.tolist()} lies beyond the {usable} records of a pass; "
                "the sources changed since the checkpoint was written"
            )
        ws[self.blob("position")] = np.array([pass_ + 1, 0] if stop >= usable else [pass_, stop], dtype=np.int64)
        return _Claim(pass_, offset, stop)

    def _load(self, ws: Workspace, claim: _Claim) -> Any:
        index, count = self.shard
        records = self._records(ws)
        contiguous = not self.shuffle and count == 1
        picks = None if contiguous else self._order(claim.pass_, records)[claim.start : claim.stop]
        columns = []
        for i, source in enumerate(self._zarr):
            if source is None:
                data = self._state(ws, f"source.{i}")
                columns.append(np.array(data[claim.start : claim.stop] if contiguous else data[picks], copy=True))
            elif contiguous:
                columns.append(np.asarray(self._source(i)[claim.start : claim.stop]))
            elif not self.shuffle:
                first = index + claim.start * count
                columns.append(np.asarray(self._source(i)[first : index + claim.stop * count : count]))
            else:
                columns.append(np.asarray(self._source(i).oindex[picks]))
        return columns[0] if len(columns) == 1 else tuple(columns)

    def read(self, ws: Workspace) -> Any:
        """The next batch (an array, or a tuple of arrays for several sources), or ``None``."""
        return self._next(ws)

    def __repr__(self) -> str:
        return (
            f"ArrayReader(name={self.name!r}, node={self.node!r}, sources={len(self._zarr)}, "
            f"batch_size={self.batch_size}, shuffle={self.shuffle}, num_passes={self.num_passes}, shard={self.shard})"
        )
