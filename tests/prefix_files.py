"""What a fault test compares before and after: the files under a checkpoint prefix."""

from __future__ import annotations

from pathlib import Path


def files(prefix: str) -> dict[str, bytes]:
    """Every file under the prefix but the lock, by relative path."""
    root = Path(prefix)
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != "lock.json"
    }
