"""TLS end to end: a ``dask scheduler`` and ``daskjobs worker`` processes with certificates made by
trustme, a checkpointed job over ``tls://``, plain and certificate-less clients refused; and
``node_cluster(security=True)`` in process."""

from __future__ import annotations

import sys
import time

import dask
import numpy as np
import pytest
from distributed import Client, Security
from processes import logs, spawn, start_scheduler, stop_group

import daskjobs as dj
from daskjobs.errors import SessionLostError

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]

STARTUP = 60.0


def define_job() -> dj.Job:
    with dj.Cluster(), dj.Job(name="tls") as job:
        with dj.Node("a"):
            with job.init_group:
                dj.Task(lambda ws: ws.__setitem__("w", np.zeros(4)))
            dj.Task(lambda ws: ws.__setitem__("w", ws["w"] + ws.epoch))
        with dj.Node("b"):
            with job.init_group:
                dj.Task(lambda ws: ws.__setitem__("n", 0))
            dj.Task(lambda ws: ws.__setitem__("n", ws["n"] + 1))
    return job


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    """``(ca file, cert file, key file)``: one CA, one certificate for 127.0.0.1 and localhost."""
    trustme = pytest.importorskip("trustme")
    tmp_path = tmp_path_factory.mktemp("certificates")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    paths = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.cert_pem.write_to_path(str(paths[0]))
    cert.cert_chain_pems[0].write_to_path(str(paths[1]))
    cert.private_key_pem.write_to_path(str(paths[2]))
    return tuple(str(p) for p in paths)


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory, certificates):
    """A TLS scheduler process and ``daskjobs worker`` processes for nodes a and b, shared by the
    module's tests (none changes it); yields ``(address, client Security)``."""
    tmp_path = tmp_path_factory.mktemp("tls_cluster")
    ca, cert, key = certificates
    tls = ["--tls-ca-file", ca, "--tls-cert", cert, "--tls-key", key]
    security = Security(tls_ca_file=ca, tls_client_cert=cert, tls_client_key=key, require_encryption=True)
    processes = []
    try:
        scheduler, address = start_scheduler(tmp_path, *tls, protocol="tls", timeout=STARTUP)
        processes.append(scheduler)
        assert address.startswith("tls://127.0.0.1:")
        for node in ("a", "b"):
            argv = [sys.executable, "-m", "daskjobs.cli", "worker", address, "--node", node, "--host", "127.0.0.1"]
            log = tmp_path / f"worker-{node}.log"
            processes.append(spawn([*argv, "--local-directory", str(tmp_path / "workers"), *tls], log))
        deadline = time.monotonic() + STARTUP
        with Client(address, security=security, timeout=STARTUP, set_as_default=False) as client:
            wanted = {dj.node_resource("a"), dj.node_resource("b")}
            while not wanted <= {
                r for w in client.scheduler_info(n_workers=-1)["workers"].values() for r in w["resources"]
            }:
                assert time.monotonic() < deadline, logs(tmp_path)
                time.sleep(0.1)
        yield address, security
    finally:
        for process in processes:
            stop_group(process)


@pytest.mark.slow
def test_checkpointed_job_over_tls(tls_cluster, tmp_path):
    """A whole checkpointed job runs over TLS and ends as on LocalSession; its checkpoints verify."""
    address, security = tls_cluster
    with dj.LocalSession() as local:
        dj.JobRunner(define_job(), max_epochs=5, progress=False).train(local)
        expected = local.fetch("w", "a")
    prefix = str(tmp_path / "ckpt")
    with dj.DaskSession(address, security=security) as session:
        runner = dj.JobRunner(define_job(), dj.MultiNodeCheckpointManager(prefix), max_epochs=5, progress=False)
        assert runner.train(session) == 5
        assert np.array_equal(session.fetch("w", "a"), expected)
        assert int(session.fetch("n", "b")) == 5
    assert np.array_equal(dj.open_checkpoint(prefix)["a"]["w"], expected)


@pytest.mark.slow
def test_plain_and_untrusted_clients_are_refused(tls_cluster, certificates, tmp_path):
    """A plain-TCP client, and a TLS client whose certificate another CA signed, cannot connect."""
    import trustme

    address, _ = tls_cluster
    ca, _, _ = certificates
    with dask.config.set({"daskjobs.connect-timeout": "3s"}):
        with pytest.raises(SessionLostError, match="cannot connect"):
            dj.DaskSession(address.replace("tls://", "tcp://"))
        other = trustme.CA().issue_cert("127.0.0.1")
        paths = tmp_path / "other-cert.pem", tmp_path / "other-key.pem"
        other.cert_chain_pems[0].write_to_path(str(paths[0]))
        other.private_key_pem.write_to_path(str(paths[1]))
        stranger = Security(
            tls_ca_file=ca, tls_client_cert=str(paths[0]), tls_client_key=str(paths[1]), require_encryption=True
        )
        with pytest.raises(SessionLostError, match="cannot connect"):
            dj.DaskSession(address, security=stranger)


def test_node_cluster_with_temporary_tls():
    """node_cluster(security=True) listens on tls:// only; a session on it works, plain TCP is refused."""
    with dj.node_cluster(["a"], processes=False, security=True) as cluster:
        assert cluster.scheduler_address.startswith("tls://127.0.0.1:")
        with dj.DaskSession(cluster) as session:
            session.feed("x", 2.5, node="a")
            assert float(session.fetch("x", "a")) == 2.5
        with dask.config.set({"daskjobs.connect-timeout": "3s"}), pytest.raises(SessionLostError):
            dj.DaskSession(cluster.scheduler_address.replace("tls://", "tcp://"))
