"""Shared fixtures: sessions of every kind, fresh clusters of node names, checkpoint prefixes."""

from __future__ import annotations

import sys

import pytest
from marker_rule import ProcessWatch, needs_marker

import daskjobs as dj

NODES = ["local", "a", "b", "c", "ps", "trainer_0", "trainer_1", "trainer_2"]
"""Node names tests may use: every session kind serves exactly these."""


WORKERS = {"w0": ["local", "a", "c", "trainer_0", "trainer_2"], "w1": ["b", "ps", "trainer_1"]}
"""How the shared test cluster spreads NODES over two worker processes."""


@pytest.fixture(scope="session")
def shared_cluster():
    """One process-based cluster for every DaskSession-parametrised test of the run."""
    with dj.node_cluster(WORKERS, nthreads=2) as cluster:
        yield cluster


def _make_local(request: pytest.FixtureRequest) -> dj.Session:
    return dj.LocalSession()


def _make_dask(request: pytest.FixtureRequest) -> dj.Session:
    return dj.DaskSession(request.getfixturevalue("shared_cluster"))


SESSION_KINDS = {"local": _make_local, "dask": _make_dask}
"""Session factories by name: in-process, and DaskSession over worker processes."""


@pytest.fixture(params=[pytest.param("local"), pytest.param("dask", marks=pytest.mark.cluster)])
def session(request: pytest.FixtureRequest):
    """A fresh open session of each kind, closed after the test."""
    made = SESSION_KINDS[request.param](request)
    yield made
    made.close()


@pytest.fixture(autouse=True)
def fresh_cluster():
    """Keep node registrations of one test out of the thread's default cluster."""
    with dj.Cluster() as cluster:
        yield cluster


@pytest.fixture
def prefix(tmp_path):
    """A checkpoint prefix on real disk."""
    return str(tmp_path / "ckpt")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Test modules (and the shared jobs of :mod:`jobs`) are pickled by value so that worker
    processes can run their steps; the cases a ``representative`` mark leaves out are ``matrix``."""
    import cloudpickle
    import jobs

    cloudpickle.register_pickle_by_value(jobs)
    for module in {item.module for item in items if item.module is not None}:
        if module.__name__ in sys.modules:
            cloudpickle.register_pickle_by_value(module)
    mark_the_matrix(items, check_ids=not any("::" in arg for arg in config.args))


def mark_the_matrix(items: list[pytest.Item], check_ids: bool) -> None:
    """``@pytest.mark.representative("id", ...)`` on a parametrised test: the default run keeps the
    cases of those ids; the others are marked ``matrix`` (``python -m pytest -m matrix`` runs them).
    With ``check_ids`` (no test was picked by its node id) an id that is no case is an error."""
    cases: dict[tuple[str, str], list[pytest.Item]] = {}
    for item in items:
        if item.get_closest_marker("representative") is not None:
            cases.setdefault((item.path, getattr(item, "originalname", item.name)), []).append(item)
    for (path, function), found in cases.items():
        keep = set(found[0].get_closest_marker("representative").args)
        unknown = keep - {item.callspec.id for item in found}
        if unknown and check_ids:
            raise pytest.UsageError(f"{path}::{function}: representative cases {sorted(unknown)} are not parametrised")
        for item in found:
            if item.callspec.id not in keep:
                item.add_marker(pytest.mark.matrix)


_watch = ProcessWatch()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Start watching for processes the test starts (its fixtures' included)."""
    _watch.start()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Fail a fast-lane test (neither ``slow`` nor ``cluster``) that started a Python process."""
    try:
        result = yield
    finally:
        started = _watch.stop()
    if started and needs_marker({mark.name for mark in item.iter_markers()}):
        pytest.fail(
            f"{item.nodeid} started {', '.join(sorted(set(started)))}: mark it slow (or cluster, for worker "
            "processes) to keep it out of the fast lane (tests/README.md, Markers)",
            pytrace=False,
        )
    return result


@pytest.fixture(scope="session")
def moto_server():
    """An S3 emulator (moto) on 127.0.0.1; yields its endpoint URL."""
    import os

    from moto.server import ThreadedMotoServer

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_prefix(moto_server, request):
    """A fresh bucket on the moto server; yields ``(url, storage_options)``."""
    import uuid

    import s3fs

    options = {"endpoint_url": moto_server, "key": "testing", "secret": "testing", "use_listings_cache": False}
    bucket = f"daskjobs-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**options).mkdir(bucket)
    return f"s3://{bucket}/ckpt", options
