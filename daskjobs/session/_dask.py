"""DaskSession: TaskGroups run on a ``distributed`` cluster, node workspaces live on the workers."""

from __future__ import annotations

import contextlib
import html
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import CancelledError
from typing import Any, TypeVar

from distributed import Client, Future
from distributed.comm.core import CommClosedError

from .._config import config_timeout
from .._execution.lowering import Dep, LoweredGraph
from .._execution.node_run import abandon_node_run
from .._execution.plan import NodePlan, NodeResult, RunFailed
from .._execution.shipping import pack_plan
from .._model.values import validate_name
from ..errors import NodeLostError, SessionClosedError, SessionLostError
from ._base import Session
from ._client import connect, dashboard_link, gather_within, scheduler_rpc, send_at_once, when_all_done
from ._elastic import Placer
from ._losses import DISTRIBUTED_FAILURES, Watchdog, lost_node_error, with_departure
from ._placement import WorkerTable, node_resource
from ._plugin import OnWorker, WorkerStates, call_on_node, drop_session, register_workspaces, wait_for_steps
from ._worker_process import quiet_compute_failures

T = TypeVar("T")

logger = logging.getLogger("daskjobs")

_WATCH_INTERVAL = 0.5
"""Seconds between checks, while a run is in flight, that its nodes still have workers (a pool
node whose worker left is placed again at once: the check is most of the time a loss takes)."""


def _keep_group() -> None:
    """The anchor task of a session: its result (``None``) is held while the session is open."""


_EDGE_SHARE = 1 / 1024
"""The part of a node's resources one Dask task of a run with dataflow edges asks for."""


class DaskSession(Session):
    """Runs jobs on a Dask ``distributed`` cluster; each node's workspace lives on its worker.

    A node is placed on the one worker providing the resource :func:`~daskjobs.node_resource`
    of its name (see :func:`~daskjobs.node_cluster` and ``daskjobs worker``). Before a node's
    first run the session checks that exactly one worker serves it, with the node's extra
    resources, and raises :class:`~daskjobs.errors.NodePlacementError` within seconds otherwise.
    A worker that dies or restarts is detected (its workspace would be empty) and reported as
    :class:`~daskjobs.errors.NodeLostError`. Losing the scheduler (no connection for
    ``daskjobs.connect-timeout``, default 30 s, or no answer within it) raises
    :class:`~daskjobs.errors.SessionLostError` naming its address and closes the session.
    The dashboard link is logged (INFO, logger ``daskjobs``) when the session connects, and
    shown by its ``repr`` and in Jupyter.

    Parameters
    ----------
    target : distributed.Client, cluster or str
        A synchronous client (left open by :meth:`~daskjobs.Session.close`), a cluster object such as the result
        of :func:`~daskjobs.node_cluster`, or a scheduler address such as ``"tcp://127.0.0.1:8786"``
        or ``"tls://10.0.0.5:8786"``. For the last two the session makes its own client and
        closes it with the session. An address that does not parse raises
        :class:`~daskjobs.errors.SchedulerAddressError` and a refused connection
        :class:`~daskjobs.errors.SessionLostError`, both at once; a scheduler that does not
        answer is waited for at most ``daskjobs.connect-timeout``.
    security : distributed.Security or bool, optional
        TLS settings of the client made for an address (``distributed.Security(tls_ca_file=...,
        tls_client_cert=..., tls_client_key=..., require_encryption=True)``); a cluster object
        brings its own. Not allowed with a Client, which has its own.

    Notes
    -----
    Workspaces are private to the session: two sessions on one cluster never see each other's
    blobs, and :meth:`~daskjobs.Session.close` frees the session's workspaces on the workers.

    The scheduler and the workers unpickle the tasks, so ``daskjobs`` (and the modules that
    define your steps, unless they are defined in ``__main__``) must be importable there.

    Examples
    --------
    >>> import daskjobs as dj
    >>> with dj.node_cluster(["ps"]) as cluster, dj.DaskSession(cluster) as session:  # doctest: +SKIP
    ...     session.feed("w", 1.5, node="ps")
    ...     print(session.fetch("w"))
    1.5
    """

    background_flushes = True

    def __init__(self, target: Client | str | Any, *, security: Any = None) -> None:
        client, owned = connect(target, security)
        super().__init__()
        quiet_compute_failures()
        self._client, self._owns_client = client, owned
        self._address: str = scheduler_rpc(client).address
        self._states = WorkerStates(self.session_id)
        self._interrupted = False
        """A run was interrupted while it gathered: its steps may still run (see :meth:`start_job_run`)."""
        try:
            register_workspaces(client)
            # While this future is held, the scheduler keeps the one task group all of the
            # session's keys map to, so each run does not leave a new group behind in its spans.
            self._anchor = client.submit(_keep_group, key=f"daskjobs-{self.session_id}-anchor", pure=False)
            self._placer = Placer(client, self.session_id, self._workers)
        except BaseException:
            if owned:
                client.close()
            raise
        self._dashboard = dashboard_link(client)
        logger.info(
            "DaskSession %s connected to the Dask scheduler at %s; dashboard: %s",
            self.session_id,
            self._address,
            self._dashboard or "none (the scheduler serves no dashboard)",
        )

    @property
    def client(self) -> Client:
        """The ``distributed.Client`` the session submits to."""
        return self._client

    @property
    def dashboard_link(self) -> str | None:
        """The URL of the scheduler's Dask dashboard, or ``None`` if it serves none."""
        return self._dashboard

    def start_job_run(self, job: str) -> None:
        """Start a new run of ``job`` (see :meth:`Session.start_job_run`).

        After an interrupted run (a second Ctrl-C abandons an epoch at once) its steps may still
        run on the workers, and would write into the workspaces the new run uses: the new run
        first waits for them, at most ``daskjobs.straggler-timeout`` (60 s); then the session
        is closed, with :class:`~daskjobs.errors.SessionClosedError`.
        """
        super().start_job_run(job)
        if self._interrupted:
            self._await_stragglers()

    def _await_stragglers(self) -> None:
        timeout = config_timeout("straggler-timeout")
        keys = wait_for_steps(self._client, f"daskjobs-{self.session_id}-", timeout)
        if keys:
            self.close()
            raise SessionClosedError(
                f"DaskSession {self.session_id} closed: steps of an interrupted run still run on the workers "
                f"after {timeout:g} s (daskjobs.straggler-timeout): {', '.join(keys[:3])}; they could change the "
                "workspaces of a new run. Restart the workers (client.restart()) and open a new DaskSession"
            )
        self._interrupted = False

    # -- seams ----------------------------------------------------------------------------
    def _provider(self) -> WorkerStates:
        return self._states

    def _execute(self, graph: LoweredGraph, meanwhile: Callable[[], None] | None = None) -> dict[str, NodeResult]:
        self._check_client()
        self._preflight(graph.nodes(), graph.resources)
        node_of = {task.key: task.node for task in graph.tasks}
        futures = self._submit(graph)
        if meanwhile is not None:
            meanwhile()
        results = self._settle_and_gather(futures, node_of, list(graph.result_keys.values()))
        return dict(zip(graph.result_keys, results, strict=True))

    def _submit(self, graph: LoweredGraph) -> dict[str, Future]:
        """Submit every task of ``graph`` (in dependency order), with Dep args replaced by futures."""
        for task in graph.tasks:  # pack the steps first: a step that cannot be pickled raises before any submit
            for arg in task.args:
                if isinstance(arg, NodePlan):
                    pack_plan(arg)  # made once per plan, then reused by every run
        send_at_once(self._client)
        futures: dict[str, Future] = {}
        # A run with dataflow edges is one Dask task per daskjobs task: each takes a sliver of its
        # node's resources and leaves the worker's thread pool, so that all of a node's tasks run
        # at once, as they do in the one Dask task of a run without edges.
        share = _EDGE_SHARE if len(graph.tasks) > len(graph.result_keys) else 1.0
        for task in graph.tasks:
            needs = {node_resource(task.node): 1, **graph.resources.get(task.node, {})}
            try:
                futures[task.key] = self._client.submit(
                    OnWorker(task.fn, seceding=share != 1.0),
                    *(futures[a.key] if isinstance(a, Dep) else a for a in task.args),
                    key=task.key,
                    resources={name: amount * share for name, amount in needs.items()},
                    pure=False,
                )
            except Exception:
                self._client.cancel(list(futures.values()))
                raise
        return futures

    def _call_on_node(self, node: str, fn: Callable[..., T], *args: Any) -> T:
        self._check_client()
        self._preflight([node], {})
        key = f"daskjobs-{self.session_id}-call-{uuid.uuid4().hex}"
        resources = {node_resource(node): 1}
        token = self._tokens.get(node)
        futures = {
            key: self._client.submit(
                call_on_node, self._states, node, token, fn, *args, key=key, resources=resources, pure=False
            )
        }
        try:
            return self._settle_and_gather(futures, {key: node}, [key])[0]
        except RunFailed as failed:
            error = failed.error
        raise error

    def _abandon(self, graph: LoweredGraph, run_key: str) -> None:
        # Only placed nodes can hold an open run; the others failed placement or lost their worker.
        for node in graph.nodes():
            if node in self._placer.placement:
                with contextlib.suppress(Exception):
                    self._call_on_node(node, abandon_node_run, run_key)

    def _known_nodes(self) -> list[str]:
        return self._placer.known_nodes()

    def _shutdown(self) -> None:
        try:
            self._placer.release(config_timeout("connect-timeout"))
            self._anchor.release()
            if self._client.status == "running":
                self._client.run(drop_session, self.session_id, on_error="ignore")
        except Exception as exc:  # best effort: workspaces also go away with their workers
            logger.warning("could not free the workspaces of %r on the workers: %s", self, exc)
        finally:
            if self._owns_client:
                self._client.close()

    # -- placement ------------------------------------------------------------------------
    def _check_client(self) -> None:
        """Raise unless the session is open and its client connected (waiting for a reconnect)."""
        self._check_open()
        status = self._client.status
        if status == "running":
            return
        if status in ("closing", "closed") and not self._owns_client:
            raise SessionClosedError(
                f"the Dask client of DaskSession {self.session_id} was closed (by its owner, or after it lost "
                f"the scheduler at {self._address}); open a new session"
            )
        self._await_reconnect()

    def _await_reconnect(self) -> None:
        """Return once the client is connected again; after ``daskjobs.connect-timeout`` close the
        session and raise :class:`SessionLostError`."""
        timeout = config_timeout("connect-timeout")
        deadline = time.monotonic() + timeout
        while self._client.status != "running" and time.monotonic() < deadline:
            if self._client.status in ("closing", "closed"):
                break
            time.sleep(0.05)
        if self._client.status != "running":
            raise self._lost_scheduler(f"no connection to it for {timeout:g} s (daskjobs.connect-timeout)")

    def _lost_scheduler(self, why: str) -> SessionLostError:
        """Close the session (it can do nothing without its scheduler) and return the error to raise."""
        self._open = False
        if self._owns_client:
            with contextlib.suppress(Exception):
                self._client.close(timeout=2)
        return SessionLostError(
            f"lost the Dask scheduler at {self._address}: {why}. DaskSession {self.session_id} is closed and "
            "its node workspaces are gone; committed checkpoints are intact: run the job again (on a running "
            "scheduler) to resume from the last committed epoch."
        )

    def _workers(self) -> WorkerTable:
        """The scheduler's worker table, asked for afresh; the scheduler must answer within
        ``daskjobs.connect-timeout``."""
        timeout = config_timeout("connect-timeout")
        deadline = time.monotonic() + timeout
        while True:
            self._check_client()
            try:
                identity = self._client.sync(
                    scheduler_rpc(self._client).identity,
                    n_workers=-1,
                    callback_timeout=max(deadline - time.monotonic(), 0.1),
                )
                return identity["workers"]
            except OSError as exc:  # TimeoutError, CommClosedError
                if time.monotonic() >= deadline:
                    raise self._lost_scheduler(f"it did not answer for {timeout:g} s ({exc!r})") from None
                time.sleep(0.1)

    def _preflight(self, nodes: Iterable[str], resources: Mapping[str, Mapping[str, float]]) -> None:
        """Place the nodes not placed yet (or needing resources not yet checked)."""
        unchecked = self._placer.unchecked(nodes, resources)
        if unchecked:
            self._placer.place(unchecked, config_timeout("preflight-timeout"))

    @property
    def placement(self) -> dict[str, str]:
        """Node -> the address of the worker serving it, for the nodes this session placed (empty
        before the first run). Logged at INFO (logger ``daskjobs``) whenever it changes.

        Examples
        --------
        >>> session.placement  # doctest: +SKIP
        {'ps': 'tcp://127.0.0.1:40211', 'trainer': 'tcp://127.0.0.1:40211'}
        """
        return dict(self._placer.placement)

    def check_nodes(
        self, nodes: Iterable[object] | None = None, resources: Mapping[str, Mapping[str, float]] | None = None
    ) -> None:
        """Place the nodes now, or raise NodePlacementError at once.

        A node with a pinned worker (one started with its resource) must have exactly one, with
        the node's extra resources; any other node goes to a pool worker that has them (a worker
        without node resources), which is given the node's resource now (see :attr:`placement`).
        The runner calls this for the whole job before anything runs, so that its nodes are
        spread over the pool together.

        Parameters
        ----------
        nodes : iterable of str or Node, optional
            The nodes to place; default: every node this session has used.
        resources : mapping, optional
            Node -> extra resources its worker must provide, besides those the session's
            groups already asked for (e.g. ``{"trainer": {"GPU": 1}}``).

        Raises
        ------
        NodePlacementError
            Naming the nodes that cannot be placed, their demands and the workers.

        Examples
        --------
        >>> session.check_nodes(["ps", "trainer"], {"trainer": {"GPU": 1}})  # doctest: +SKIP
        """
        self._check_open()
        names = self._names(nodes)
        self._placer.unchecked(names, resources or {})
        self._placer.place(names, 0)

    def wait_for_nodes(
        self,
        nodes: Iterable[object] | None = None,
        timeout: float | None = None,
        resources: Mapping[str, Mapping[str, float]] | None = None,
    ) -> None:
        """Wait until each node has a worker (e.g. while workers start, or after a restart), and place it.

        A pinned node waits for its own worker; a pool node goes to any fitting pool worker (it
        waits only while there is none).

        Parameters
        ----------
        nodes : iterable of str or Node, optional
            The nodes to wait for; default: every node this session has used.
        timeout : float, optional
            Seconds to wait; default: the Dask config value ``daskjobs.placement-timeout`` (10 s).
        resources : mapping, optional
            Node -> extra resources its worker must provide, as for :meth:`check_nodes`.

        Raises
        ------
        NodePlacementError
            If some node still has no worker, several pinned ones, or none with the node's
            extra resources when the time is up; the message lists the available workers.

        Examples
        --------
        >>> session.wait_for_nodes(["ps", "trainer"], timeout=30)  # doctest: +SKIP
        """
        self._check_open()
        names = self._names(nodes)
        self._placer.unchecked(names, resources or {})
        self._placer.place(names, config_timeout("placement-timeout") if timeout is None else timeout)

    def rebalance(self, before: Callable[[], object] | None = None) -> dict[str, str]:
        """Move nodes to workers that joined since the last look, when that evens the spread.

        The runner calls it at each epoch boundary. ``daskjobs.rebalance`` ``"never"`` (Dask
        config) turns it off. A node moves with its workspace, sent from its old worker to the
        new one; ``before()`` is called first when anything moves (the runner commits the epoch's
        checkpoint there).

        Returns
        -------
        dict
            Node -> the address of its new worker, for the nodes that moved.

        Examples
        --------
        >>> session.rebalance()  # doctest: +SKIP
        {'trainer_1': 'tcp://127.0.0.1:40811'}
        """
        self._check_client()
        moves = self._placer.moves()
        if moves:
            if before is not None:
                before()
            tokens = self._placer.move(moves, self._states, self._tokens, self._settle_and_gather)
            self._tokens.update(tokens)
        return moves

    def _names(self, nodes: Iterable[object] | None) -> list[str]:
        return list(self._placer.demands) if nodes is None else [validate_name(str(n), "node") for n in nodes]

    # -- waiting and errors ---------------------------------------------------------------
    def _settle_and_gather(self, futures: dict[str, Future], node_of: dict[str, str], keys: list[str]) -> list[Any]:
        """Gather ``keys`` in one transfer once they are done, watching for lost nodes.

        On failure, wait for the run's other futures too (no straggler may touch a workspace
        after the run was reported), then raise :class:`RunFailed` with the first error in
        submission (dependency) order, with its remote traceback, and the results of the nodes
        (by ``node_of``) whose key finished; distributed's failures become NodeLostError. The
        futures are released first and no raised traceback refers to them, so failed runs
        leave no keys on the scheduler.
        """
        every = list(futures.values())
        watchdog = Watchdog(self._workers, self._client.cancel, every, node_of, self._placer.gone)
        tb = None
        partial: dict[str, Any] = {}
        try:
            results = self._gather_watched([futures[k] for k in keys], watchdog)
            if isinstance(results, list) and len(results) == len(keys):
                return results
            if isinstance(results, list):  # the failed ones skipped: keep what the others returned
                done = [k for k in keys if futures[k].status == "finished"]
                if len(done) == len(results):
                    partial = {node_of[k]: result for k, result in zip(done, results, strict=True)}
            error: BaseException | None = results if isinstance(results, NodeLostError) else self._drain(watchdog)
            if error is None:
                erred = [f for f in every if f.status == "error"][:1]
                if erred:
                    error, tb = erred[0].exception(), erred[0].traceback()
                    erred.clear()
                else:
                    error = CancelledError("the run's Dask futures were cancelled")
        except (CancelledError, CommClosedError) as exc:
            error = exc
        except (KeyboardInterrupt, SystemExit):  # the run's steps may run on: the next run waits for them
            self._interrupted = True
            raise
        finally:
            futures.clear()
            every.clear()
        if self._client.status != "running":
            # The scheduler connection broke (distributed cancelled the futures): a lost
            # session unless the client reconnects within daskjobs.connect-timeout.
            self._await_reconnect()
        if isinstance(error, DISTRIBUTED_FAILURES):
            raise RunFailed(self._lost(lost_node_error(error, node_of)), partial) from None
        if isinstance(error, NodeLostError):
            error = self._lost(error)
        if not isinstance(error, Exception):  # an interruption, as in a LocalSession: no failure of the run
            raise error.with_traceback(tb)
        raise RunFailed(error.with_traceback(tb), partial)

    def _gather_watched(self, futures: list[Future], watchdog: Watchdog) -> list[Any] | NodeLostError:
        """The results of the successful ``futures`` once all are done, or the watchdog's error."""
        results, pending = self._client.sync(gather_within, self._client, futures, _WATCH_INTERVAL)
        while pending is not None:
            lost = watchdog.check()
            if lost is not None:
                return lost
            results, pending = self._client.sync(gather_within, self._client, futures, _WATCH_INTERVAL, pending)
        return results

    def _drain(self, watchdog: Watchdog) -> NodeLostError | None:
        """Block until all of the run's futures are done, or return the watchdog's error."""
        done = when_all_done(watchdog.futures)
        while not done.wait(_WATCH_INTERVAL):
            lost = watchdog.check()
            if lost is not None:
                return lost
        return None

    def _lost(self, error: NodeLostError) -> NodeLostError:
        """``error`` told with why the nodes' worker left (see :func:`with_departure`); the nodes are
        placed again before they next run."""
        incarnations = {n: self._tokens[n].partition("-")[0] for n in error.nodes if n in self._tokens}
        error = with_departure(self._client, self._placer.placement, error, incarnations)
        self._placer.forget(error.nodes)
        return error

    def __repr__(self) -> str:
        state = "open" if self.is_open() else "closed"
        return (
            f"DaskSession({state}, id={self.session_id}, scheduler={self._address}, dashboard={self._dashboard}, "
            f"placement={{{self._placer.describe()}}})"
        )

    def _repr_html_(self) -> str:
        state = "open" if self.is_open() else "closed"
        link = html.escape(self._dashboard or "")
        dashboard = f'<a href="{link}" target="_blank">{link}</a>' if link else "none"
        rows = [
            ("state", html.escape(state)),
            ("id", html.escape(self.session_id)),
            ("scheduler", html.escape(self._address)),
            ("dashboard", dashboard),
            ("placement", html.escape(self._placer.describe() or "none yet")),
        ]
        cells = "".join(f"<tr><th style='text-align:left'>{k}</th><td>{v}</td></tr>" for k, v in rows)
        return f"<div><strong>DaskSession</strong><table>{cells}</table></div>"
