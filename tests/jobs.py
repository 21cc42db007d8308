"""Jobs that several test files run (``tests/check_jobs.py`` holds those of ``daskjobs check``).

The module is pickled by value (``tests/conftest.py``): its steps run on worker processes that
cannot import it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

import daskjobs as dj


def _nowhere(point: str) -> None:
    """The default ``reach``: nothing happens at any point."""


def two_coupled_nodes(name: str, reach: Callable[[str], None] = _nowhere, *, download_and_exit: bool = False) -> dj.Job:
    """Nodes ``a`` and ``b`` coupled both ways, so that losing either stops the other.

    Each epoch ``a`` publishes ``w = weights + epoch``; ``b`` appends ``w.sum()`` to its ``history``
    and acknowledges it; ``a``'s ``update`` (``weights += 1``) waits for the acknowledgement. With
    ``download_and_exit``, ``b``'s download group sums its history into ``downloaded`` and its exit
    group sets ``exited = downloaded + 1``.

    ``b``'s steps call ``reach(point)`` first, at the points ``"init"``, ``"epoch-<N>"``,
    ``"download"`` and ``"exit"``: a test kills the worker there, for example.

    Examples
    --------
    >>> job = two_coupled_nodes("coupled")
    >>> sorted(node.name for node in job.nodes())
    ['a', 'b']
    """
    with dj.Cluster(), dj.Job(name=name) as job:
        with dj.Node("a"):
            with job.init_group:
                dj.Task(lambda ws: ws.__setitem__("weights", np.zeros(8)))
            publish = dj.Task(lambda ws: ws.__setitem__("w", ws["weights"] + ws.epoch), outputs="w")
        with dj.Node("b"):
            with job.init_group:

                def init_b(ws):
                    reach("init")
                    ws["history"] = np.zeros(0)

                dj.Task(init_b)

            def consume(ws):
                reach(f"epoch-{ws.epoch}")
                ws["history"] = np.append(ws["history"], ws["w"].sum())
                ws["ack"] = ws["w"].sum()

            consumed = dj.Task(consume, inputs={"w": publish.outputs()[0]}, outputs="ack")
            if download_and_exit:
                with job.download_group:

                    def download(ws):
                        reach("download")
                        ws["downloaded"] = ws["history"].sum()

                    dj.Task(download, workspace_type=dj.WorkspaceType.GLOBAL)
                with job.exit_group:

                    def exit_step(ws):
                        reach("exit")
                        ws["exited"] = ws["downloaded"] + 1

                    dj.Task(exit_step, workspace_type=dj.WorkspaceType.GLOBAL)
        with dj.Node("a"):
            dj.Task(
                lambda ws: ws.__setitem__("weights", ws["weights"] + 1.0),
                name="update",
                inputs={"ack": consumed.outputs()[0]},
            )
    return job
