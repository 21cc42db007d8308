"""Graceful stop (SPEC §1.8): SIGINT/SIGTERM once finishes and commits the running epoch, twice abandons it.

Each case runs a training script in a subprocess (the signal handlers live on its main thread),
signals it at a known point — a step writes ``started-<epoch>`` and then sleeps — and checks
the exception, the committed epochs, the lock, and that stderr holds no flood of tracebacks.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import daskjobs as dj

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    import numpy as np
    import daskjobs as dj
    from daskjobs.checkpoint._managers.metadata import CommitRecordHandler

    kind, prefix, markers, sleep = sys.argv[1], sys.argv[2], Path(sys.argv[3]), float(sys.argv[4])
    nodes = sys.argv[5].split(",")

    QUICK = markers / "quick"  # kind "reuse": made before the second run, whose steps do not sleep
    # (a file, not a global: the workers keep the steps they were sent for the first run)

    def step(ws):
        (markers / f"started-{ws.epoch}").touch()
        if ws.epoch >= 2 and kind not in ("commit", "cluster-commit") and not QUICK.exists():
            time.sleep(sleep)
        ws["n"] = ws["n"] + 1

    class SignalsWhileCommitting(CommitRecordHandler):
        # kind "commit": the process signals itself twice right after epoch 2's record is written
        def write(self, epoch):
            super().write(epoch)
            if epoch == 2:
                for _ in range(2):
                    os.kill(os.getpid(), int(sys.argv[6]))
                    time.sleep(0.6)  # apart by more than half a second: two requests, not one

    def main():
        with dj.Cluster(), dj.Job(name="graceful") as job:
            for node in nodes:
                with dj.Node(node):
                    with job.init_group:
                        dj.Task(lambda ws: ws.__setitem__("n", np.int64(0)))
                    dj.Task(step)
        manager = dj.MultiNodeCheckpointManager(prefix)
        if kind == "commit":
            manager = dj.MultiNodeCheckpointManager(prefix, metadata_handler=SignalsWhileCommitting(manager.store))
        if kind == "cluster-commit":
            # fault injection: both signals land while epoch 2's commit record is being written, on a
            # cluster, where that commit is written while a later epoch runs (a later one waits)
            write_record, struck = manager.store.commit, []

            def commit(record, **options):
                if record["epoch"] == 2 and not struck:
                    struck.append(True)
                    for _ in range(2):
                        os.kill(os.getpid(), int(sys.argv[6]))
                        time.sleep(0.6)
                return write_record(record, **options)

            manager.store.commit = commit
        runner = dj.JobRunner(job, manager, max_epochs=6, progress=False)
        started = time.monotonic()
        try:
            if kind not in ("cluster", "reuse", "cluster-commit"):
                runner.train(None)
            else:
                with dj.node_cluster(["a", "b"], nthreads=2) as cluster, dj.DaskSession(cluster) as session:
                    try:
                        runner.train(session)
                    except (KeyboardInterrupt, dj.errors.JobInterruptedError):
                        print(f"RAISED-AFTER {time.monotonic() - started:.2f}", flush=True)
                        if kind != "reuse":
                            raise
                        # The same session again: the abandoned step still sleeps on a worker.
                        QUICK.touch()
                        again = dj.JobRunner(job, dj.MultiNodeCheckpointManager(prefix), max_epochs=4, progress=False)
                        try:
                            last = again.train(session)
                        except dj.errors.SessionClosedError as exc:
                            print(f"CLOSED {exc}", flush=True)
                            os._exit(0)
                        print(f"REUSED {last} {[int(session.fetch('n', node)) for node in nodes]}", flush=True)
                        time.sleep(sleep)  # the abandoned step would have written by now
                        print(f"LATER {[int(session.fetch('n', node)) for node in nodes]}", flush=True)
                        os._exit(0)
        except KeyboardInterrupt as exc:
            print(f"RESULT KeyboardInterrupt - {exc}", flush=True)
            os._exit(130)
        except dj.errors.JobInterruptedError as exc:
            print(f"RESULT JobInterruptedError {exc.epoch} {exc}", flush=True)
            os._exit(143)
        print("RESULT finished", flush=True)
        os._exit(0)

    if __name__ == "__main__":
        main()
    """
)


def run_and_signal(
    tmp_path: Path, kind: str, signals: list[int], sleep: float, nodes: str = "a,b", gap: float = 0.6
) -> tuple[int, str, str, float]:
    """Start the script, wait for epoch 2 to start, send ``signals`` ``gap`` s apart; return
    (return code, stdout, stderr, seconds from the last signal to the exit). Kind ``"commit"``
    signals itself (twice ``signals[0]``) from inside the commit of epoch 2 instead."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    markers = tmp_path / "markers"
    markers.mkdir()
    prefix = str(tmp_path / "ckpt")
    child = subprocess.Popen(
        [sys.executable, str(script), kind, prefix, str(markers), str(sleep), nodes, str(int(signals[0]))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        deadline = time.monotonic() + 60
        while not (markers / "started-2").exists():
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "epoch 2 never started"
            time.sleep(0.05)
        time.sleep(0.2)
        for number, sig in enumerate(signals if kind not in ("commit", "cluster-commit") else []):
            if number:
                time.sleep(gap)
            child.send_signal(sig)
        signalled = time.monotonic()
        out, err = child.communicate(timeout=60)
        return child.returncode, out, err, time.monotonic() - signalled
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()


def committed(tmp_path: Path) -> list[int]:
    return [i.epoch for i in dj.list_checkpoints(str(tmp_path / "ckpt"))]


def lock_released(tmp_path: Path) -> bool:
    return dj.MultiNodeCheckpointManager(str(tmp_path / "ckpt")).store.read_lock() is None


CASES = [
    pytest.param("local", signal.SIGINT, id="local-SIGINT"),
    pytest.param("local", signal.SIGTERM, id="local-SIGTERM"),
    pytest.param("cluster", signal.SIGINT, id="cluster-SIGINT", marks=[pytest.mark.cluster, pytest.mark.slow]),
    pytest.param("cluster", signal.SIGTERM, id="cluster-SIGTERM", marks=[pytest.mark.cluster, pytest.mark.slow]),
]
EXPECTED = {signal.SIGINT: (130, "KeyboardInterrupt"), signal.SIGTERM: (143, "JobInterruptedError")}


@pytest.mark.representative("local-SIGINT", "local-SIGTERM", "cluster-SIGTERM")
@pytest.mark.parametrize(("kind", "sig"), CASES)
@pytest.mark.slow
def test_one_signal_commits_the_running_epoch_then_stops(tmp_path, kind, sig):
    """The running epoch 2 finishes and is committed; then the exception, with one log line saying how to resume."""
    code, out, err, _ = run_and_signal(tmp_path, kind, [sig], sleep=1.5)
    expected_code, expected_type = EXPECTED[sig]
    assert code == expected_code, (out, err)
    assert f"RESULT {expected_type}" in out
    if sig == signal.SIGTERM:
        assert "RESULT JobInterruptedError 2 " in out
    assert committed(tmp_path) == [0, 1, 2]
    assert lock_released(tmp_path)
    assert "epoch 2 is committed" in err
    assert err.count("Traceback") == 0, err
    assert len(err.splitlines()) <= 10, err
    assert dj.open_checkpoint(str(tmp_path / "ckpt")).verify() > 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.slow
def test_the_same_signal_again_within_half_a_second_is_one_request(tmp_path, sig):
    """A signal the process gets twice 0.1 s apart (a wrapper in its process group, GNU ``timeout`` or
    ``srun``, forwarding the signal the whole group got) stops gracefully: epoch 2 is committed."""
    code, out, err, _ = run_and_signal(tmp_path, "local", [sig, sig], sleep=1.5, gap=0.1)
    assert code == EXPECTED[sig][0], (out, err)
    assert committed(tmp_path) == [0, 1, 2]
    assert "epoch 2 is committed" in err, err
    assert "abandoned" not in err, err
    assert lock_released(tmp_path)


@pytest.mark.representative("local-SIGINT", "local-SIGTERM", "cluster-SIGINT")
@pytest.mark.parametrize(("kind", "sig"), CASES)
@pytest.mark.slow
def test_second_signal_abandons_the_running_epoch(tmp_path, kind, sig):
    """A second signal stops at once: nothing of epoch 2 is committed, the lock is released, no flood."""
    code, out, err, seconds = run_and_signal(tmp_path, kind, [sig, sig], sleep=20)
    expected_code, expected_type = EXPECTED[sig]
    assert code == expected_code, (out, err)
    assert f"RESULT {expected_type}" in out
    assert "abandoned" in out
    assert seconds < 15
    assert committed(tmp_path) == [0, 1]
    assert lock_released(tmp_path)
    assert len(err.splitlines()) <= 25, err
    assert dj.open_checkpoint(str(tmp_path / "ckpt")).verify() > 0
    runner = dj.JobRunner(_resumed_job(), dj.MultiNodeCheckpointManager(str(tmp_path / "ckpt")), max_epochs=3)
    assert runner.train(None) == 3
    assert [r.epoch for r in runner.history] == [2, 3]


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.representative("SIGINT")  # either signal abandons the epoch the same way
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_session_reused_after_an_abandoned_epoch_waits_for_its_step(tmp_path, sig):
    """SPEC §1.8/§4: after a second SIGINT on a DaskSession the abandoned step still runs on its
    worker; a new run on the same session waits for it (bounded), so it cannot write into the
    restored workspaces, and nothing floods stderr (the dropped gather is not left unretrieved)."""
    code, out, err, _ = run_and_signal(tmp_path, "reuse", [sig, sig], sleep=4)
    assert code == 0, (out, err)
    assert "RAISED-AFTER" in out
    assert "REUSED 4 [4, 4]" in out
    assert "LATER [4, 4]" in out
    assert committed(tmp_path) == [0, 1, 2, 3, 4]
    assert "Traceback" not in err, err
    assert "never retrieved" not in err, err


@pytest.mark.cluster
@pytest.mark.slow
def test_a_step_that_outlives_the_straggler_timeout_closes_the_session(tmp_path, monkeypatch):
    """The wait for an abandoned step is bounded (daskjobs.straggler-timeout): then the session
    is closed with SessionClosedError naming the timeout, never left half-broken."""
    monkeypatch.setenv("DASK_DASKJOBS__STRAGGLER_TIMEOUT", "1s")
    code, out, err, seconds = run_and_signal(tmp_path, "reuse", [signal.SIGINT, signal.SIGINT], sleep=30)
    assert code == 0, (out, err)
    assert "CLOSED DaskSession" in out
    assert "daskjobs.straggler-timeout" in out
    assert seconds < 20
    assert committed(tmp_path) == [0, 1]


def _resumed_job() -> dj.Job:
    with dj.Cluster(), dj.Job(name="graceful") as job:
        for node in ("a", "b"):
            with dj.Node(node):
                with job.init_group:
                    dj.Task(lambda ws: ws.__setitem__("n", 0))
                dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1))
    return job


def test_handlers_are_restored_and_threads_untouched():
    """train() on the main thread restores the previous handlers; on another thread it installs none."""
    import threading

    with dj.Cluster(), dj.Job() as job, dj.Node("a"):
        dj.Task(lambda ws: None)
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    dj.JobRunner(job, max_epochs=1, progress=False).train(None)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    done = []
    thread = threading.Thread(target=lambda: done.append(dj.JobRunner(job, max_epochs=2, progress=False).train(None)))
    thread.start()
    thread.join(30)
    assert done == [2]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.slow
def test_second_signal_abandons_a_step_running_on_the_main_thread(tmp_path, sig):
    """One node on a LocalSession runs its step on the main thread, where the second signal lands:
    it still ends the run with the signal's own error (not as a failed step), nothing of epoch 2
    committed, the lock released."""
    code, out, err, seconds = run_and_signal(tmp_path, "local", [sig, sig], sleep=20, nodes="a")
    expected_code, expected_type = EXPECTED[sig]
    assert code == expected_code, (out, err)
    assert f"RESULT {expected_type}" in out
    assert "abandoned" in out
    assert "TaskFailedError" not in out + err
    assert seconds < 15
    assert committed(tmp_path) == [0, 1]
    assert lock_released(tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.slow
def test_second_signal_during_a_commit_is_not_a_failed_save(tmp_path, sig):
    """Both signals land while the main thread commits epoch 2 (right after its record is written):
    the run ends with the signal's error naming the newest committed epoch, never retried as a
    failed save nor reported as a CheckpointWriteError."""
    code, out, err, _ = run_and_signal(tmp_path, "commit", [sig], sleep=0)
    expected_code, expected_type = EXPECTED[sig]
    assert code == expected_code, (out, err)
    assert f"RESULT {expected_type}" in out
    assert "failed (attempt" not in err
    assert "CheckpointWriteError" not in out + err
    assert committed(tmp_path)[:3] == [0, 1, 2]
    newest = committed(tmp_path)[-1]
    assert f"epoch {newest} is committed" in out
    if sig == signal.SIGTERM:
        assert f"RESULT JobInterruptedError {newest} " in out
    assert lock_released(tmp_path)


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.representative("SIGTERM")  # both signals: test_second_signal_during_a_commit_is_not_a_failed_save
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_commit_cut_short_by_a_second_signal_is_made_before_any_later_one(tmp_path, sig):
    """On a cluster an epoch's commit record is written while a later epoch runs: both signals land
    while epoch 2's record is being written, with epoch 3 waiting for its own. The way out commits
    epoch 2 first and then epoch 3: the committed epochs have no gap."""
    code, out, err, _ = run_and_signal(tmp_path, "cluster-commit", [sig], sleep=0)
    expected_code, expected_type = EXPECTED[sig]
    assert code == expected_code, (out, err)
    assert f"RESULT {expected_type}" in out
    epochs = committed(tmp_path)
    assert epochs[:3] == [0, 1, 2]
    assert epochs == list(range(len(epochs)))
    assert "Traceback" not in err
    assert lock_released(tmp_path)


@pytest.mark.slow
def test_a_local_session_run_interrupted_abruptly_waits_for_its_steps_before_the_next_run():
    """A KeyboardInterrupt in the driver (a second Ctrl-C) leaves a LocalSession's step running in
    its thread: the next run waits for it, so the straggler cannot overwrite what that run writes."""
    import threading
    import time

    ended: dict[str, float] = {}

    def slow(ws):
        time.sleep(1.0)
        ws["x"] = "straggler"
        ended["straggler"] = time.monotonic()

    def slow_b(ws):
        time.sleep(1.0)

    def new_run(ws):
        ended["new run started"] = time.monotonic()
        ws["x"] = "new run"

    with dj.LocalSession() as session, dj.Cluster():
        with dj.TaskGroup(dj.WorkspaceType.GLOBAL) as group:
            dj.Task(slow, node="a")
            dj.Task(slow_b, node="b")
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # other libraries' handlers aside
        try:
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
            with pytest.raises(KeyboardInterrupt):
                session.run(group)
        finally:
            signal.signal(signal.SIGINT, previous)
        with dj.Node("a"):
            session.run(new_run)
        time.sleep(1.0)
        assert session.fetch("x", node="a") == "new run"
        assert ended["straggler"] <= ended["new run started"]
