"""Connecting to a scheduler (SPEC §4 "Connecting"): an address that does not parse, or a scheduler
that refuses the connection, raises within 5 s with one message naming the address, although
``daskjobs.connect-timeout`` is 30 s; the interpreter exits at once afterwards; ``daskjobs run
--scheduler`` does the same with exit code 1 (refused) or 2 (an address that does not parse)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import daskjobs as dj
from daskjobs._config import config_timeout
from daskjobs.errors import SessionLostError

pytestmark = pytest.mark.timeout(120)

PROMPT = 5.0
"""Seconds within which a failure to connect is reported (the connect timeout stays 30 s)."""

FORM = "expected tcp://HOST:PORT, tls://HOST:PORT or HOST:PORT; schemes: inproc, tcp, tls, ucx, ws, wss"

CONNECT = textwrap.dedent(
    """
    import json, sys, time
    import daskjobs as dj
    from distributed import Security

    address, tls = sys.argv[1], json.loads(sys.argv[2])
    security = Security(tls_ca_file=tls[0], tls_client_cert=tls[1], tls_client_key=tls[2]) if tls else None
    started = time.monotonic()
    try:
        dj.DaskSession(address, security=security)
    except Exception as exc:
        failed = time.monotonic()
        chained = exc.__cause__ is not None or (exc.__context__ is not None and not exc.__suppress_context__)
        print(json.dumps([type(exc).__name__, str(exc), failed - started, failed, chained]), flush=True)
    """
)


def closed_port() -> int:
    """A port of 127.0.0.1 where nothing listens (it was free a moment ago)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def env() -> dict[str, str]:
    """This checkout first on the path; the default timeouts (connect-timeout 30 s) untouched."""
    root = str(Path(dj.__file__).resolve().parents[1])
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    return {**clean, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


@pytest.fixture
def certificates(tmp_path):
    """``[ca file, cert file, key file]`` made by trustme for 127.0.0.1."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    paths = tmp_path / "ca.pem", tmp_path / "cert.pem", tmp_path / "key.pem"
    ca.cert_pem.write_to_path(str(paths[0]))
    cert.cert_chain_pems[0].write_to_path(str(paths[1]))
    cert.private_key_pem.write_to_path(str(paths[2]))
    return [str(p) for p in paths]


def refused(address: str) -> str:
    return (
        f"cannot connect to the Dask scheduler at {address}: the connection was refused (nothing listens on that "
        "port). Check that the scheduler runs at that address; "
    )


CASES = {
    "words": ("not an address", "SchedulerAddressError", "'{a}' is not a Dask scheduler address: it has no HOST:PORT"),
    "scheme only": ("tcp://", "SchedulerAddressError", "'{a}' is not a Dask scheduler address: it has no HOST:PORT"),
    "port too big": (
        "127.0.0.1:99999",
        "SchedulerAddressError",
        "'{a}' is not a Dask scheduler address: port 99999 is outside 1-65535",
    ),
    "port zero": ("tcp://127.0.0.1:0", "SchedulerAddressError", "'{a}' is not a Dask scheduler address: port 0 is"),
    "http": ("http://x", "SchedulerAddressError", "'{a}' is not a Dask scheduler address: unknown scheme 'http'"),
    "spaces": (" tcp://127.0.0.1:1", "SchedulerAddressError", "'{a}' is not a Dask scheduler address: it is empty"),
    "empty": ("", "SchedulerAddressError", "'{a}' is not a Dask scheduler address: it is empty"),
    "inproc of nobody": (
        "inproc://x",
        "SchedulerAddressError",
        "'{a}' is not a Dask scheduler address here: not enough values to unpack",
    ),
    "tcp refused": ("tcp://127.0.0.1:{port}", "SessionLostError", refused("{a}")),
    "no scheme refused": ("127.0.0.1:{port}", "SessionLostError", refused("{a}")),
    "localhost refused": ("tcp://localhost:{port}", "SessionLostError", refused("{a}")),
    "tls without settings": (
        "tls://127.0.0.1:{port}",
        "DefinitionTypeError",
        "the scheduler at {a} speaks TLS, and no TLS settings were given: pass security=distributed.Security(",
    ),
    "tls refused": ("tls://127.0.0.1:{port}", "SessionLostError", refused("{a}") + "pass security= with"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.slow
def test_failing_to_connect_is_prompt_with_one_message_and_a_prompt_exit(case, certificates, tmp_path):
    """Each bad address raises its daskjobs error, with one message (nothing chained) naming the
    address, within 5 s; the interpreter then exits within 5 s (no half-made client left behind)."""
    template, kind, message = CASES[case]
    address = template.format(port=closed_port())
    tls = certificates if case == "tls refused" else []
    script = tmp_path / "connect.py"
    script.write_text(CONNECT)
    process = subprocess.run(
        [sys.executable, str(script), address, json.dumps(tls)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    exited = time.monotonic()
    assert process.returncode == 0, process.stderr
    name, text, took, failed, chained = json.loads(process.stdout)
    assert (name, chained) == (kind, False), text
    assert text.startswith(message.format(a=address)), text
    if kind == "SchedulerAddressError" and "here" not in text:
        assert text.endswith(f"({FORM})")
    assert took < PROMPT, f"{case}: raised after {took:.1f} s"
    assert exited - failed < PROMPT, f"{case}: the interpreter exited {exited - failed:.1f} s after the error"
    assert process.stderr == ""


@pytest.mark.parametrize("client", ["plain tcp", "untrusted tls"])
def test_a_tls_scheduler_refusing_a_client_is_prompt(client):
    """A TLS scheduler refuses a plain-TCP client, and a client whose certificates it does not trust,
    within 5 s (not after the 30 s connect timeout)."""
    from distributed import Security

    assert config_timeout("connect-timeout") == 30
    with dj.node_cluster(["a"], processes=False, security=True) as cluster:
        address = cluster.scheduler_address
        if client == "plain tcp":
            address, security = address.replace("tls://", "tcp://"), None
        else:
            security = Security.temporary()
        started = time.monotonic()
        with pytest.raises(SessionLostError) as caught:
            dj.DaskSession(address, security=security)
        took = time.monotonic() - started
    assert str(caught.value).startswith(f"cannot connect to the Dask scheduler at {address}: ")
    assert caught.value.__cause__ is None
    assert took < PROMPT


def test_a_listening_scheduler_still_connects():
    """The quick attempt before the client does not disturb a scheduler that answers."""
    with dj.node_cluster(["a"], processes=False) as cluster:
        port = cluster.scheduler_address.rpartition(":")[2]
        for address in (cluster.scheduler_address, f"127.0.0.1:{port}", f"tcp://localhost:{port}"):
            with dj.DaskSession(address) as session:
                session.feed("x", 2.5, node="a")
                assert float(session.fetch("x", "a")) == 2.5


JOB = textwrap.dedent(
    """
    import daskjobs as dj


    def step(ws):
        ws["n"] = ws.get("n", 0) + 1


    def make():
        with dj.Cluster(), dj.Job(name="connect") as job, dj.Node("a"):
            dj.Task(step)
        return job


    job = make()
    """
)


DASKJOBS_RUN = [sys.executable, "-m", "daskjobs", "run", "job.py:job", "--max-epochs", "2"]


@pytest.mark.parametrize(
    ("template", "code", "message"),
    [
        ("tcp://127.0.0.1:{port}", 1, refused("{a}")),
        ("127.0.0.1:99999", 2, "--scheduler {a}: '{a}' is not a Dask scheduler address: port 99999 is outside"),
        ("http://x", 2, "--scheduler {a}: 'http://x' is not a Dask scheduler address: unknown scheme 'http'"),
    ],
    ids=["refused", "port too big", "http"],
)
@pytest.mark.slow
def test_run_on_an_unreachable_scheduler_exits_promptly(tmp_path, template, code, message):
    """``daskjobs run --scheduler`` at a closed port exits 1, at a malformed address 2, within 5 s
    of starting to connect, with one line on stderr and nothing created under --checkpoint."""
    address = template.format(port=closed_port())
    (tmp_path / "job.py").write_text(JOB)
    started = time.monotonic()
    process = subprocess.run(
        [*DASKJOBS_RUN, "--scheduler", address, "--checkpoint", str(tmp_path / "ckpt")],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    took = time.monotonic() - started
    assert process.returncode == code, process.stderr
    lines = process.stderr.strip().splitlines()
    assert len(lines) == 1, process.stderr
    assert lines[0].startswith("daskjobs run: error: " + message.format(a=address)), lines[0]
    assert "Traceback" not in process.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == ["job.py"]
    assert took < PROMPT + _startup(), f"daskjobs run took {took:.1f} s"


def _startup() -> float:
    """Seconds this machine takes to start ``python -m daskjobs --version`` (imports included)."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "daskjobs", "--version"], env=env(), capture_output=True, timeout=60)
    return time.monotonic() - started
