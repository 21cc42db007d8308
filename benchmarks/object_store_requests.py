"""Requests one checkpointed epoch costs on an object store (S3 through s3fs, emulated by moto).

A moto S3 server on 127.0.0.1, wrapped in a counter of every HTTP request it serves, classified as
``PUT`` (an object written), ``COPY`` (a server-side copy: delta reuse), ``GET`` (an object read),
``LIST``, ``HEAD`` and ``DELETE`` (one object, or one batch). A job of ``--nodes`` nodes with
``--blobs`` small blobs each (one of them changing every epoch) runs ``--epochs`` epochs on a
``LocalSession`` with a checkpoint every epoch under an ``s3://`` prefix; the requests served
between two consecutive ``on_epoch`` calls are one epoch's (its save, its commit, retention).
Reported per variant: the median over the epochs after the first two, per request kind.

Variants: ``full`` (``delta=False``: every chunk written), ``delta`` (unchanged chunks copied on the
server), ``delta+keep_last=3`` (retention deletes an epoch per epoch).

The floor of the format for one epoch: per node one PUT of each chunk and array metadata (full),
or one PUT of each changed chunk and a COPY of each unchanged chunk and array metadata (delta), and
one PUT of the manifest; then one PUT of the commit record. Anything above that is bookkeeping (the
lock check before the commit, the node's marker, listings).

Prints a table (stderr) and JSON (stdout, or ``--json FILE``).

Run: ``python benchmarks/object_store_requests.py [--nodes 2] [--blobs 10] [--epochs 8]``
"""

from __future__ import annotations

import argparse
import collections
import itertools
import logging
import os
import statistics
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from _report import write_json

import daskjobs as dj

KINDS = ("PUT", "COPY", "GET", "LIST", "HEAD", "DELETE", "other")
BUCKET = "daskjobs-bench"


class Counter:
    """A WSGI middleware counting the requests of the app it wraps, by kind."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app
        self.counts: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        with self.lock:
            self.counts[kind(environ)] += 1
        return self.app(environ, start_response)

    def snapshot(self) -> collections.Counter[str]:
        with self.lock:
            return collections.Counter(self.counts)


def kind(environ: dict[str, Any]) -> str:
    """The kind of an S3 request (see the module's docstring)."""
    method, query = environ["REQUEST_METHOD"], environ.get("QUERY_STRING", "")
    if method == "PUT":
        return "COPY" if "HTTP_X_AMZ_COPY_SOURCE" in environ else "PUT"
    if method == "GET":
        path = environ.get("PATH_INFO", "/").strip("/")
        return "LIST" if "list-type" in query or "prefix=" in query or "/" not in path else "GET"
    if method == "POST" and "delete" in query:
        return "DELETE"
    return method if method in KINDS else "other"


@contextmanager
def moto_server() -> Iterator[tuple[dict[str, Any], Counter]]:
    """A counting moto S3 server on 127.0.0.1 with one bucket; yields s3fs storage options and the counter."""
    import boto3
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    for name, value in {
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "x",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(name, value)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    counter = Counter(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, counter, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        yield (
            {"key": "x", "secret": "x", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}},
            counter,
        )
    finally:
        server.shutdown()
        thread.join()


def define_job(nodes: int, blobs: int) -> dj.Job:
    """Every node holds ``blobs`` arrays of 1 KiB; ``b00`` changes every epoch, the others never."""

    def init(ws: dj.Workspace) -> None:
        ws.update({f"b{i:02d}": np.full(128, float(i)) for i in range(blobs)})

    def step(ws: dj.Workspace) -> None:
        ws["b00"] = ws["b00"] + 1.0

    with dj.Cluster(), dj.Job(name="requests") as job:
        for index in range(nodes):
            with dj.Node(f"n{index}"):
                with job.init_group:
                    dj.Task(init, name="init")
                dj.Task(step, name="step")
    return job


def per_epoch(options: dict[str, Any], counter: Counter, args: argparse.Namespace, **manager: Any) -> dict[str, Any]:
    """Run the job once; the requests of each epoch after the first two, by kind."""
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}"
    seen: list[collections.Counter[str]] = []
    runner = dj.JobRunner(
        define_job(args.nodes, args.blobs),
        dj.MultiNodeCheckpointManager(url, storage_options=options, **manager),
        max_epochs=args.epochs,
        progress=False,
        on_epoch=lambda record: seen.append(counter.snapshot()),
    )
    before = counter.snapshot()
    with dj.LocalSession() as session:
        runner.train(session)
    total = counter.snapshot() - before
    epochs = [later - earlier for earlier, later in itertools.pairwise(seen[1:])]
    return {
        "median_per_epoch": {k: statistics.median(e[k] for e in epochs) for k in KINDS},
        "whole_run": {k: total[k] for k in KINDS},
        "epochs_counted": len(epochs),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--blobs", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=8, help="epochs per run (at least 7: 5 counted)")
    parser.add_argument("--json", help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    args.epochs = max(7, args.epochs)
    variants = {
        "full": {"delta": False},
        "delta": {"delta": True},
        "delta+keep_last=3": {"delta": True, "keep_last": 3},
    }
    with moto_server() as (options, counter):
        results = {name: per_epoch(options, counter, args, **manager) for name, manager in variants.items()}
    floor = {
        "full": {"PUT": args.nodes * (2 * args.blobs + 1) + 1},
        "delta": {"PUT": args.nodes * 2 + 1, "COPY": args.nodes * (2 * args.blobs - 1)},
    }
    result = {"nodes": args.nodes, "blobs": args.blobs, "variants": results, "floor_per_epoch": floor}
    print(f"requests per epoch ({args.nodes} nodes x {args.blobs} blobs, medians)", file=sys.stderr)
    print(f"{'variant':20s}" + "".join(f"{k:>8s}" for k in KINDS) + f"{'total':>8s}", file=sys.stderr)
    for name, found in results.items():
        row = found["median_per_epoch"]
        print(f"{name:20s}" + "".join(f"{row[k]:8g}" for k in KINDS) + f"{sum(row.values()):8g}", file=sys.stderr)
    for name, row in floor.items():
        cells = {k: row.get(k, 0) for k in KINDS}
        print(
            f"{'floor ' + name:20s}" + "".join(f"{cells[k]:8g}" for k in KINDS) + f"{sum(cells.values()):8g}",
            file=sys.stderr,
        )
    write_json(result, args.json)
    return result


if __name__ == "__main__":
    main()
