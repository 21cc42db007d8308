"""Per-epoch progress: a tqdm bar on terminals and in notebooks, and one log line per epoch."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .history import EpochRecord

logger = logging.getLogger("daskjobs")


def _interactive() -> bool:
    if "ipykernel" in sys.modules:
        return True
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


class EpochProgress:
    """Shows epoch time, checkpoint time and stop values as epochs complete."""

    def __init__(
        self, enabled: bool | None, job_name: str, *, start: int, total: int | None, dashboard: str | None = None
    ) -> None:
        self._bar = None
        if enabled is None:
            enabled = _interactive()
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total,
                initial=max(start - 1, 0),
                desc=f"job {job_name}",
                unit="epoch",
                dynamic_ncols=True,
                leave=True,
            )
            if dashboard:
                self._bar.write(f"Dask dashboard: {dashboard}")

    def update(self, record: EpochRecord) -> None:
        """Advance by one finished epoch."""
        logger.info(
            "epoch %d: %.3f s, checkpoint %.3f s (%d bytes), stop %s",
            record.epoch,
            record.seconds,
            record.checkpoint_seconds,
            record.checkpoint_bytes,
            record.stop_values,
        )
        if self._bar is not None:
            stops = ",".join(f"{k}={int(v)}" for k, v in record.stop_values.items())
            self._bar.set_postfix_str(
                f"epoch {record.epoch} {record.seconds:.2f}s ckpt {record.checkpoint_seconds:.2f}s"
                f"{' ' + stops if stops else ''}",
                refresh=False,
            )
            self._bar.update(1)

    def close(self) -> None:
        """Finish the bar."""
        if self._bar is not None:
            self._bar.close()
