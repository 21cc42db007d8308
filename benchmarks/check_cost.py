"""SPEC §6 ``daskjobs check``: proving the demo job resumes exactly vs one uninterrupted run of it.

Times, as a user would from a shell, ``daskjobs check daskjobs.demo:demo_job`` (the stop and kill
modes, the three default interruption points: 2 references + 6 interrupted runs, each resumed, 14
driver processes) against ``daskjobs run daskjobs.demo:demo_job --checkpoint DIR`` (one
uninterrupted, checkpointed run), both on the default session (a ``node_cluster`` of the demo's
nodes, started by the command) and with ``--local``. Runs alternate (run, check, run, check, …);
each figure is the median over rounds. Target: check <= 10x one run. Prints a table and a JSON
line.

    python benchmarks/check_cost.py [--rounds 5] [--sessions cluster local] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import daskjobs as dj

TARGET = "daskjobs.demo:demo_job"


def timed(args: list[str]) -> float:
    """Seconds ``python -m daskjobs ARGS`` takes, start to exit (it must succeed)."""
    root = str(Path(dj.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "daskjobs", *args], capture_output=True, text=True, env=env, timeout=900
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"daskjobs {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return seconds


def one_run(session: list[str]) -> float:
    folder = tempfile.mkdtemp(prefix="daskjobs-bench-check-")
    try:
        return timed(["run", TARGET, "--checkpoint", f"{folder}/ckpt", "--no-progress", *session])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of (one run, one check), interleaved")
    parser.add_argument("--sessions", nargs="+", choices=("cluster", "local"), default=["cluster", "local"])
    parser.add_argument("--quick", action="store_true", help="3 rounds, --local only")
    args = parser.parse_args()
    rounds, sessions = (3, ["local"]) if args.quick else (args.rounds, args.sessions)
    flags = {"cluster": [], "local": ["--local"]}
    results = {}
    for kind in sessions:
        runs, checks = [], []
        for _ in range(rounds):
            runs.append(one_run(flags[kind]))
            checks.append(timed(["check", TARGET, "--mode", "stop", "--mode", "kill", *flags[kind]]))
        run, check = statistics.median(runs), statistics.median(checks)
        results[kind] = {
            "run_s": round(run, 2),
            "check_s": round(check, 2),
            "ratio": round(check / run, 2),
            "runs_s": [round(s, 2) for s in runs],
            "checks_s": [round(s, 2) for s in checks],
        }
    print(f"{'session':>8} {'one run':>9} {'check':>9} {'ratio':>7}   (medians of {rounds} interleaved rounds)")
    for kind, r in results.items():
        print(f"{kind:>8} {r['run_s']:>7.2f} s {r['check_s']:>7.2f} s {r['ratio']:>6.2f}x")
    print(json.dumps({"benchmark": "check_cost", "rounds": rounds, "target": "check <= 10x one run", **results}))


if __name__ == "__main__":
    main()
