"""The driver process of one run of a check with a string target.

``python -m daskjobs.testing._child SPEC.json`` loads the job as ``daskjobs run`` does (its file and
the helper modules next to it travel to the workers by value), runs it on a new session
(in-process, or on the scheduler the spec names) as the spec's action says, and writes what
happened as JSON to the spec's ``result`` path. Its exit code is 0 when it wrote an outcome and 1
when it wrote an error; a run that kills itself writes nothing.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..runner._targets import load_job
from ..session import DaskSession, LocalSession
from ._runs import Action, perform


def main(argv: list[str]) -> int:
    """Carry out the run the spec file ``argv[0]`` describes; returns the exit code."""
    spec: dict[str, Any] = json.loads(Path(argv[0]).read_text())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("daskjobs").addHandler(handler)
    logging.getLogger("daskjobs").setLevel(logging.WARNING)
    result: dict[str, Any]
    try:
        job = load_job(spec["target"])
        address = spec.get("address")
        with DaskSession(address) if address else LocalSession() as session:
            outcome = perform(
                job,
                spec["prefix"],
                Action(**spec["action"]),
                session,
                max_epochs=spec["max_epochs"],
                in_memory=bool(spec.get("in_memory")),
            )
        result = {"job": job.name, "outcome": asdict(outcome)}
    except BaseException as exc:  # every failure is reported to the parent, by name
        message = f"{type(exc).__name__}: {exc}"
        cause = exc.__cause__
        if cause is not None and str(cause) not in message:
            message += f" (caused by {type(cause).__name__}: {cause})"
        result = {"error": message, "traceback": "".join(traceback.format_exception(exc))}
    Path(spec["result"]).write_text(json.dumps(result))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
