"""``daskjobs checkpoints list|show|verify|prune|unlock PREFIX``.

Every action first checks that the prefix exists and holds daskjobs checkpoints (its
``__daskjobs__`` folder); otherwise it is a usage error (exit 2) and nothing is created.
``list``, ``show`` and ``verify`` only read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..checkpoint import CheckpointStore, open_checkpoint
from ..checkpoint._format.records import record_bytes
from ..checkpoint._managers.damage import damaged_files, epoch_span, newest_intact, sharing_epochs
from ..checkpoint._protocol.lock import local_holder, unlock
from ..checkpoint._protocol.retention import kept_epochs
from ..errors import CheckpointError, CheckpointNotFoundError
from ._common import OK, Subparsers, UsageError, add_storage_options, add_verbose, epoch_number, positive_int

if TYPE_CHECKING:
    from ..checkpoint._format.documents import CommitRecord

OWN_FOLDER = "__daskjobs__"
"""The folder every daskjobs prefix has (commit records and the writer lock)."""

JSON_PREVIEW = 200
"""Characters of a JSON value that ``show`` prints."""
_SHOWN_FAILURES = 3
"""Damaged epochs whose error ``verify`` repeats in its final message (every one has its line above)."""


class CheckFailed(CheckpointError):
    """A check found problems (``verify``, or corrupt commit records in ``list``): exit code 1."""


def add_checkpoints_parser(subparsers: Subparsers) -> None:
    """Register ``daskjobs checkpoints list|show|verify|prune|unlock``."""
    parser = subparsers.add_parser(
        "checkpoints",
        help="inspect, verify, prune and unlock the checkpoints under a prefix",
        description="Inspect, verify, prune and unlock the checkpoints under a prefix (a path or fsspec URL).",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, text in [
        ("list", "committed epochs, one line each (metrics and stop values included)"),
        ("show", "the blobs of one committed epoch (default: the latest)"),
        ("verify", "read and verify every blob of one epoch (default: of every epoch); exit 1 on damage"),
        ("prune", "delete old committed epochs and uncommitted leftovers (keeps the newest epoch)"),
        ("unlock", "remove the writer lock of a runner that is gone"),
    ]:
        action = actions.add_parser(name, help=text, description=text)
        action.add_argument("db_prefix", metavar="PREFIX", help="checkpoint prefix: a path or fsspec URL")
        add_storage_options(action)
        add_verbose(action)
        if name in ("show", "verify"):
            action.add_argument(
                "--epoch",
                type=epoch_number,
                help="the epoch (default: " + ("the latest)" if name == "show" else "every committed epoch)"),
            )
        if name in ("list", "show"):
            action.add_argument("--json", action="store_true", help="print JSON")
        if name == "prune":
            action.add_argument("--keep-last", type=positive_int, help="keep the newest N committed epochs")
            action.add_argument("--keep-every", type=positive_int, help="keep epochs divisible by N")
            action.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
        if name == "unlock":
            action.add_argument("--force", action="store_true", help="remove the lock even if its holder may still run")
    parser.set_defaults(handler=run_checkpoints)


def run_checkpoints(args: argparse.Namespace) -> int:
    """Carry out a ``daskjobs checkpoints`` action; returns the exit code."""
    store = open_prefix(args.db_prefix, dict(args.storage_options))
    return _ACTIONS[args.action](store, args)


def open_prefix(prefix: str, storage_options: dict[str, Any]) -> CheckpointStore:
    """The store of an existing daskjobs prefix; :class:`UsageError` (creating nothing) otherwise."""
    store = CheckpointStore(prefix, storage_options)
    if not store.fs.exists(store.url):
        raise UsageError(f"checkpoint prefix {store.url} does not exist")
    if not store.fs.exists(f"{store.url}/{OWN_FOLDER}"):
        raise UsageError(
            f"{store.url} holds no daskjobs checkpoints (no {OWN_FOLDER} folder): "
            "is it the prefix given to the checkpoint manager?"
        )
    return store


def scan_commits(store: CheckpointStore) -> Iterator[tuple[int, CommitRecord | CheckpointError]]:
    """Each committed epoch, oldest first, with its validated record or the error reading it."""
    scan = getattr(store, "scan_commits", None)
    if scan is not None:
        found = scan()
        yield from sorted(found.items() if isinstance(found, Mapping) else found, key=lambda pair: pair[0])
        return
    for epoch in store.committed_epochs():
        try:
            yield epoch, store.read_commit(epoch)
        except CheckpointNotFoundError:
            continue  # deleted while we listed (retention of a running job)
        except CheckpointError as exc:
            yield epoch, exc


def summary(record: CommitRecord) -> dict[str, Any]:
    """The per-epoch facts ``list`` prints: epoch, job, nodes, bytes, created, stop values, metrics,
    and (with ``--json``) the commit record's format version."""
    return {
        "epoch": record["epoch"],
        "job": record.get("job", ""),
        "nodes": list(record.get("nodes", [])),
        "bytes": record_bytes(record)[0],
        "created": record.get("created", ""),
        "stop_values": dict(record.get("stop_values", {})),
        "metrics": dict(record.get("metrics", {})),
        "format_version": record.get("format_version"),
    }


def _list(store: CheckpointStore, args: argparse.Namespace) -> int:
    rows, broken = [], []
    for epoch, record in scan_commits(store):
        if isinstance(record, Exception):
            broken.append(f"epoch {epoch}: {record}")
            rows.append({"epoch": epoch, "error": str(record)})
        else:
            rows.append(summary(record))
    if not rows:  # a prefix holding no checkpoint is a usage error, as for show and verify
        raise UsageError(f"no committed checkpoint under {store.url}")
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            print(_list_line(row))
    if broken:  # marked above; a listing still succeeds (``verify`` is the check that fails)
        print(
            f"warning: {len(broken)} corrupt commit record(s) under {store.url}: " + "; ".join(broken),
            file=sys.stderr,
        )
    return OK


def _list_line(row: Mapping[str, Any]) -> str:
    if "error" in row:
        return f"{row['epoch']:8d}  CORRUPT commit record: {row['error']}"
    stops = ",".join(name for name, value in row["stop_values"].items() if value) or "-"
    metrics = "".join(f"  {name}={value:.6g}" for name, value in sorted(row["metrics"].items()))
    return (
        f"{row['epoch']:8d}  {row['job']}  nodes={','.join(row['nodes'])}  {row['bytes']} bytes  "
        f"{row['created']}  stopped={stops}{metrics}"
    )


def _committed_or_usage_error(store: CheckpointStore, epoch: int | None) -> int:
    """``epoch`` if committed (default: the latest); a usage error listing the committed epochs otherwise."""
    committed = _committed(store)
    if epoch is None:
        return committed[-1]
    if epoch not in committed:
        raise UsageError(
            f"epoch {epoch} is not committed under {store.url}; committed epochs: {_epochs_text(committed)}"
        )
    return epoch


def _committed(store: CheckpointStore) -> list[int]:
    """The committed epochs, ascending; a usage error if there is none."""
    committed = store.committed_epochs()
    if not committed:
        raise UsageError(f"no committed checkpoint under {store.url}")
    return committed


def _epochs_text(epochs: list[int]) -> str:
    shown = [str(e) for e in epochs] if len(epochs) <= 20 else [*map(str, epochs[:10]), "...", *map(str, epochs[-10:])]
    return ", ".join(shown)


def _shown_epoch(store: CheckpointStore, epoch: int | None) -> tuple[int, list[str]]:
    """The epoch ``show`` shows: ``epoch`` if committed, by default the newest commit whose record
    reads; and the newer commits whose records are corrupt (marked, not shown)."""
    if epoch is not None:
        return _committed_or_usage_error(store, epoch), []
    broken = []
    for candidate in reversed(_committed(store)):
        try:
            store.read_commit(candidate)
        except CheckpointNotFoundError:  # deleted since it was listed
            continue
        except CheckpointError as exc:
            broken.append(f"epoch {candidate}: {exc}")
            continue
        return candidate, broken
    raise CheckFailed(f"every commit record under {store.url} is corrupt: " + "; ".join(broken))


def _show(store: CheckpointStore, args: argparse.Namespace) -> int:
    epoch, broken = _shown_epoch(store, args.epoch)
    view = open_checkpoint(store.url, epoch, store.storage_options)
    if broken:
        print(
            f"warning: {len(broken)} newer corrupt commit record(s) under {store.url}: " + "; ".join(broken),
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(view.record, indent=2))
        return OK
    for line in broken:
        print(f"CORRUPT commit record of {line}")
    record = view.record
    print(f"job {view.job}, epoch {view.epoch}, created {record.get('created', '?')}")
    stops = dict(record.get("stop_values", {}))
    if stops:
        print("  stop values: " + ", ".join(f"{name}={value}" for name, value in stops.items()))
    metrics = record.get("metrics", {})
    if metrics:
        print("  metrics: " + ", ".join(f"{name}={value:.6g}" for name, value in sorted(metrics.items())))
    for node in view.nodes:
        for name, meta in sorted(view[node].blobs().items()):
            print(f"  {node}/{name}: {_describe(view, node, name, meta)}")
    return OK


def _describe(view: Any, node: str, blob: str, meta: Mapping[str, Any]) -> str:
    """``dtype shape`` of an array blob; the (shortened) JSON text of a JSON blob."""
    if _is_array(meta):
        return f"{meta['dtype']} {tuple(meta['shape'])}"
    value = view[node][blob]
    if isinstance(value, np.ndarray):
        return f"{value.dtype.str} {value.shape}"
    text = json.dumps(value)
    return "json " + (text if len(text) <= JSON_PREVIEW else text[: JSON_PREVIEW - 3] + "...")


def _is_array(meta: Mapping[str, Any]) -> bool:
    """Whether a blob's record entry describes a numpy array (anything else is read to be shown)."""
    if meta.get("kind", "array") != "array" or "shape" not in meta or "dtype" not in meta:
        return False
    try:
        np.dtype(meta["dtype"])
    except (TypeError, ValueError):
        return False
    return True


def _verify(store: CheckpointStore, args: argparse.Namespace) -> int:
    if args.epoch is not None:
        _committed_or_usage_error(store, args.epoch)
        scanned: list[tuple[int, Any]] = [(args.epoch, None)]
    else:
        scanned = list(scan_commits(store))
        if not scanned:
            raise UsageError(f"no committed checkpoint under {store.url}")
    failures, damaged, intact = [], [], []
    for epoch, record in scanned:
        try:
            if isinstance(record, Exception):
                raise record
            size = open_checkpoint(store.url, epoch, store.storage_options).verify()
        except CheckpointNotFoundError as exc:
            if args.epoch is not None:
                failures.append(str(exc))
                print(f"epoch {epoch}: MISSING")
            continue  # deleted by retention while we verified
        except CheckpointError as exc:
            failures.append(str(exc))
            damaged.append(epoch)
            print(f"epoch {epoch}: CORRUPT")
            continue
        intact.append(epoch)
        print(f"epoch {epoch}: OK ({size} bytes verified)")
    if failures:
        _explain_damage(store, damaged, intact, [epoch for epoch, _ in scanned])
        more = f"; and {len(failures) - _SHOWN_FAILURES} more" if len(failures) > _SHOWN_FAILURES else ""
        raise CheckFailed(
            f"verification failed under {store.url}: {len(failures)} damaged epoch(s): "
            + "; ".join(failures[:_SHOWN_FAILURES])
            + more
        )
    return OK


def _explain_damage(store: CheckpointStore, damaged: list[int], intact: list[int], checked: list[int]) -> None:
    """After the per-epoch lines: each damaged file with every epoch that shares it (one file
    hard-linked into the epochs since the last one written in full), then the newest epoch that
    verifies and how to go on from it."""
    committed = store.committed_epochs()
    explained: set[int] = set()
    for epoch in damaged:
        if epoch in explained:
            continue
        for file in damaged_files(store, epoch):
            sharing = sharing_epochs(store, file, committed)
            explained.update(sharing)
            print(f"damaged {file.describe()}: {file.problem}")
            print(f"  shared by epoch{'s' if len(sharing) > 1 else ''} {epoch_span(sharing)}")
    newest = max(intact, default=None) if set(checked) == set(committed) else newest_intact(store, committed, damaged)
    if newest is None:
        print(
            f"no committed epoch verifies: start afresh with `daskjobs run TARGET --checkpoint {store.url} --fresh` "
            "(the committed epochs are deleted when the new epoch 0 commits)"
        )
    elif newest == committed[-1]:
        print(f"newest epoch that verifies: {newest}, the latest")
    else:
        print(
            f"newest epoch that verifies: {newest}; resume from it with `daskjobs run TARGET --checkpoint {store.url} "
            f"--resume-from {newest}` (the epochs after it are deleted when the first new epoch commits)"
        )


def _prune(store: CheckpointStore, args: argparse.Namespace) -> int:
    if not store.committed_epochs():  # a prefix holding no checkpoint is a usage error, as for the others
        raise UsageError(f"no committed checkpoint under {store.url}")
    if args.dry_run:
        return _prune_locked(store, args)
    store.acquire_lock(local_holder("daskjobs checkpoints prune"))
    try:
        return _prune_locked(store, args)
    finally:
        store.release_lock()


def _prune_locked(store: CheckpointStore, args: argparse.Namespace) -> int:
    """Delete what the retention options do not keep, after every commit record was read.

    Before anything is deleted, the kept epochs are verified newest first until one reads back
    whole (every chunk against its digest): a prune never leaves only damaged checkpoints behind.

    Raises
    ------
    CheckFailed
        A commit record cannot be read, or no kept epoch verifies: nothing was deleted (retention
        could keep or delete the wrong epochs, and a prune must not stop midway).
    """
    scanned = dict(scan_commits(store))
    broken = {epoch: error for epoch, error in scanned.items() if isinstance(error, Exception)}
    if broken:
        raise CheckFailed(
            f"refusing to prune {store.url}: {len(broken)} commit record(s) cannot be read, so nothing was "
            f"deleted: " + "; ".join(f"epoch {epoch}: {error}" for epoch, error in broken.items()) + ". "
            f"Check them with 'daskjobs checkpoints verify {store.url}', then repair each such record or "
            "delete it by hand (its epoch is then uncommitted, and the next prune removes its files)"
        )
    records = {epoch: record for epoch, record in scanned.items() if not isinstance(record, Exception)}
    epochs = sorted(records)
    if args.keep_last is None and args.keep_every is None:
        keep = set(epochs)
    else:
        keep = kept_epochs(epochs, args.keep_last, args.keep_every)
    doomed = [e for e in epochs if e not in keep]
    if doomed:
        _check_one_kept_epoch_is_sound(store, sorted(keep, reverse=True))
    for epoch in doomed:
        print(f"{'would delete' if args.dry_run else 'deleting'} epoch {epoch}")
        if not args.dry_run:
            store.delete_epoch(epoch, records[epoch]["nodes"])
    if not args.dry_run:
        for path in store.cleanup_uncommitted():
            print(f"removed uncommitted {path}")
    print(f"kept epochs {_epochs_text(sorted(keep))}" if keep else f"no committed checkpoints under {store.url}")
    return OK


def _check_one_kept_epoch_is_sound(store: CheckpointStore, kept: list[int]) -> None:
    """Verify ``kept`` (newest first) until one epoch reads back whole; :class:`CheckFailed` if none does."""
    problems = []
    for epoch in kept:
        try:
            size = open_checkpoint(store.url, epoch, store.storage_options).verify()
        except CheckpointError as exc:
            problems.append(f"epoch {epoch}: {exc}")
            print(f"kept epoch {epoch}: CORRUPT")
            continue
        print(f"kept epoch {epoch}: OK ({size} bytes verified)")
        return
    raise CheckFailed(
        f"refusing to prune {store.url}: no epoch it would keep verifies, so nothing was deleted: "
        + "; ".join(problems)
        + ". Keep more epochs (--keep-last) or check them with 'daskjobs checkpoints verify'"
    )


def _unlock(store: CheckpointStore, args: argparse.Namespace) -> int:
    holder = unlock(store, force=args.force)
    print(f"removed lock {holder}" if holder else f"no lock under {store.url}")
    return OK


_ACTIONS = {"list": _list, "show": _show, "verify": _verify, "prune": _prune, "unlock": _unlock}
