"""SPEC §6 flat cost through the runner: epoch ~``--epochs`` of a ``JobRunner.train`` costs what
epoch ~50 costs, with and without checkpoints.

``epoch_overhead.py`` measures a session's epochs alone; this script runs the whole runner (its
history, progress, commit pipeline, retention and tier-0 bookkeeping), where a per-epoch cost that
grows with the number of epochs run so far would show. The tiny 2-node job of
``save_every_epoch.py`` on a ``node_cluster(["a", "b"])``, three variants:

* ``none``: no checkpoint manager;
* ``every epoch``: a durable checkpoint committed every epoch (``keep_last=3``);
* ``tier 0``: every epoch committed in memory with one replica, durably every 10th
  (``in_memory=True, durable_every=10``).

For each variant: a fresh run of 150 epochs, a long run of ``--epochs`` epochs, another fresh run
of 150. An epoch's cost is the mean time between the ends of consecutive epochs
(``RunnerHooks.epoch_saved``) over a window of 100 epochs (whole cycles of ``durable_every``):
epochs 40 to 140 of each run ("early") and the last 100 of the long run ("late"). Reported: late vs
the long run's own early window, and late vs the fresh runs' early windows (run just before and
just after it, which cancels most drift of the machine). Target: within 10 %.

Prints a table (stderr) and JSON (stdout, or ``--json FILE``).

Run: ``python benchmarks/runner_flat.py [--epochs 5000]``
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time

from _report import write_json
from save_every_epoch import define_job

import daskjobs as dj

WINDOW = 100
EARLY = 40
FRESH_EPOCHS = 150
VARIANTS = ("none", "every epoch", "tier 0")


class EpochEnds(dj.RunnerHooks):
    """Stamps the end of every epoch, and the driver process's CPU time then."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.cpu: list[float] = []

    def epoch_saved(self, epoch: int) -> None:
        self.ends.append(time.perf_counter())
        self.cpu.append(time.process_time())


def manager_of(variant: str, prefix: str) -> dj.MultiNodeCheckpointManager | None:
    if variant == "every epoch":
        return dj.MultiNodeCheckpointManager(prefix, keep_last=3)
    if variant == "tier 0":
        return dj.MultiNodeCheckpointManager(prefix, in_memory=True, durable_every=10)
    return None


def late_start(hooks: EpochEnds) -> int:
    """The epoch end a run's late window starts at (its last two epochs, committed back to back by
    the final flush, left out)."""
    return len(hooks.ends) - 2 - WINDOW


def per_epoch_ms(stamps: list[float], start: int) -> float:
    """Mean milliseconds per epoch over the ``WINDOW`` epochs after epoch end ``start``."""
    return 1000 * (stamps[start + WINDOW] - stamps[start]) / WINDOW


def run(session: dj.Session, variant: str, epochs: int) -> EpochEnds:
    """The epoch ends of one ``train()`` of ``epochs`` epochs, on a fresh prefix."""
    prefix = tempfile.mkdtemp(prefix="runner-flat-")
    hooks = EpochEnds()
    try:
        dj.JobRunner(define_job(), manager_of(variant, prefix), max_epochs=epochs, progress=False, hooks=hooks).train(
            session
        )
    finally:
        shutil.rmtree(prefix, ignore_errors=True)
    return hooks


def measure(session: dj.Session, variant: str, epochs: int) -> dict[str, float]:
    before = run(session, variant, FRESH_EPOCHS)
    long = run(session, variant, epochs)
    after = run(session, variant, FRESH_EPOCHS)
    early, late = per_epoch_ms(long.ends, EARLY), per_epoch_ms(long.ends, late_start(long))
    fresh = statistics.mean([per_epoch_ms(before.ends, EARLY), per_epoch_ms(after.ends, EARLY)])
    early_cpu, late_cpu = per_epoch_ms(long.cpu, EARLY), per_epoch_ms(long.cpu, late_start(long))
    return {
        "early_ms": early,
        "late_ms": late,
        "fresh_ms": fresh,
        "series_ratio": late / early,
        "fresh_ratio": late / fresh,
        "driver_cpu_early_ms": early_cpu,
        "driver_cpu_late_ms": late_cpu,
        "driver_cpu_ratio": late_cpu / early_cpu,
    }


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5000, help="epochs of the long run (default 5000)")
    parser.add_argument(
        "--variant", action="append", choices=VARIANTS, help="measure only this variant (repeatable; default all)"
    )
    parser.add_argument("--json", help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    if args.epochs < 2 * (EARLY + WINDOW):
        parser.error(f"--epochs must be at least {2 * (EARLY + WINDOW)}")
    results: dict[str, dict[str, float]] = {}
    with dj.node_cluster(["a", "b"], nthreads=2) as cluster, dj.DaskSession(cluster) as session:
        run(session, "tier 0", 20)  # warm-up
        for variant in args.variant or VARIANTS:
            results[variant] = measure(session, variant, args.epochs)
    n = args.epochs
    rows = [
        f"{'variant':<12}  {'epoch ~50':>10}  {f'epoch ~{n}':>11}  {'fresh ~50':>10}  late/early  late/fresh"
        "  driver CPU ~50 / late"
    ]
    for variant, r in results.items():
        rows.append(
            f"{variant:<12}  {r['early_ms']:>7.2f} ms  {r['late_ms']:>8.2f} ms  {r['fresh_ms']:>7.2f} ms"
            f"  {r['series_ratio']:>10.3f}  {r['fresh_ratio']:>10.3f}"
            f"  {r['driver_cpu_early_ms']:.2f} / {r['driver_cpu_late_ms']:.2f} ms ({r['driver_cpu_ratio']:.3f})"
        )
    rows.append("target: within 10 % (ratio <= 1.1)")
    print("\n".join(rows), file=sys.stderr)
    result = {"epochs": n, "window": WINDOW, "variants": results}
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
