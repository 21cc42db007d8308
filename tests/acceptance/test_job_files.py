"""Steps travel as users write them (SPEC §4): a job file of top-level functions, with a helper
module and a package next to it, runs through ``daskjobs run`` on every session kind, also on a
``dask scheduler`` whose workers never saw the file; a step a worker cannot load, or that ends
badly, fails its task with a one-paragraph error and the worker lives on."""

from __future__ import annotations

import os

import pytest
from acceptance.harness import (
    SESSIONS,
    assert_quiet,
    assert_same_checkpoints,
    checkpoint_values,
    clean_env,
    finish,
    session_args,
    start_run,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.mark.representative("local-checkpoint", "cluster-no-checkpoint", "scheduler-checkpoint")
@pytest.mark.parametrize("checkpoint", [True, False], ids=["checkpoint", "no-checkpoint"])
@pytest.mark.parametrize("kind", SESSIONS)
def test_a_job_file_of_top_level_functions_runs_on_every_session_kind(
    kind, checkpoint, job_dir, elsewhere, reference, request
):
    """``daskjobs run userjob/train.py:job`` from another folder: exit 0, no traceback or ERROR, the
    last line names the last epoch, and every committed epoch equals the uninterrupted reference."""
    prefix = elsewhere / "ckpt"
    options = [*session_args(kind, request), *(["--checkpoint", str(prefix)] if checkpoint else [])]
    code, out, err = finish(
        start_run(job_dir, elsewhere, "train.py:job", *options, env=clean_env(JOB_STEP_SECONDS="0"))
    )
    assert code == 0, err
    assert_quiet(err)
    where = f"committed under {prefix}" if checkpoint else "no checkpoint (pass --checkpoint PREFIX to keep one)"
    assert out.strip().splitlines()[-1] == f"job 'acceptance': last epoch 8, {where}; ran epochs 1-8"
    if checkpoint:
        assert_same_checkpoints(checkpoint_values(prefix), reference(8))


BAD_STEPS = {
    "system_exit": "task 'ps/exits' failed in the epoch group of job 'broken' on node 'ps', epoch 1: SystemExit: 3",
    "keyboard_interrupt": (
        "task 'ps/interrupts' failed in the epoch group of job 'broken' on node 'ps', epoch 1: "
        "KeyboardInterrupt: the step gave up"
    ),
    "unpicklable_exception": (
        "task 'ps/raises_unpicklable' failed in the epoch group of job 'broken' on node 'ps', epoch 1: "
        "Unpicklable: a failure that cannot travel"
    ),
}


@pytest.mark.representative(  # every ending on a worker process, every session kind
    "system_exit-scheduler", "keyboard_interrupt-cluster", "unpicklable_exception-cluster", "keyboard_interrupt-local"
)
@pytest.mark.parametrize("kind", SESSIONS)
@pytest.mark.parametrize("target", sorted(BAD_STEPS))
def test_a_step_that_ends_badly_fails_its_task_and_the_worker_lives_on(kind, target, job_dir, elsewhere, request):
    """SystemExit, KeyboardInterrupt and an exception that cannot be pickled fail the task with
    TaskFailedError carrying the original type and message: exit 1, one paragraph, no recovery;
    an external cluster's workers are still the same processes afterwards."""
    env = clean_env(PYTHONPATH=os.pathsep.join([clean_env()["PYTHONPATH"], str(job_dir.parent / "driver_only")]))
    options = session_args(kind, request)
    before = None
    if kind == "scheduler":
        cluster = request.getfixturevalue("external_cluster")
        before = cluster.worker_address("ps")
    code, _out, err = finish(start_run(job_dir, elsewhere, f"broken.py:{target}", *options, env=env), timeout=90)
    assert code == 1, err
    assert_quiet(err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"daskjobs run: error: {BAD_STEPS[target]}"), err
    assert "died" not in err
    assert "restor" not in err
    if before is not None:
        assert cluster.worker_address("ps") == before  # the same worker: it did not die


def test_a_module_only_the_driver_can_import_fails_the_task_naming_it(job_dir, elsewhere, external_cluster):
    """A step calling into a module that is on the driver's path only (not next to the job file,
    so not sent with the steps): on a cluster whose workers cannot import it the task fails with
    TaskFailedError naming task, node and module, the worker does not die and nothing is retried."""
    env = clean_env(PYTHONPATH=os.pathsep.join([clean_env()["PYTHONPATH"], str(job_dir.parent / "driver_only")]))
    before = external_cluster.worker_address("ps")
    process = start_run(
        job_dir,
        elsewhere,
        "broken.py:missing_module",
        "--scheduler",
        external_cluster.address,
        "--checkpoint",
        str(elsewhere / "ckpt"),
        env=env,
    )
    code, _out, err = finish(process, timeout=90)
    assert code == 1, err
    assert_quiet(err)
    (line,) = err.strip().splitlines()
    assert line.startswith(
        "daskjobs run: error: task 'ps/uses_a_driver_only_module' failed in the epoch group of job 'broken' on "
        "node 'ps', epoch 1: its steps cannot be loaded on the node's worker: the worker cannot import module "
        "'driveronly'"
    ), err
    assert "died" not in err
    assert "restor" not in err
    assert external_cluster.worker_address("ps") == before
