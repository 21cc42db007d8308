"""DaskSession: TaskGroups run on a ``distributed`` cluster, node workspaces live on the workers."""

from __future__ import annotations

import contextlib
import html
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from distributed import Client, Future

from .._config import config_timeout
from .._execution.lowering import LoweredGraph
from .._execution.node_run import abandon_node_run
from .._execution.plan import NodeResult, RunFailed
from .._model.values import validate_name
from ..errors import NodeLostError, SessionClosedError
from ._base import Session
from ._client import connect, dashboard_link, scheduler_rpc
from ._connection import SchedulerConnection
from ._elastic import Placer
from ._futures import Failure, settle, submit_graph
from ._growth import SpanTrim, trim_key_cache
from ._losses import DISTRIBUTED_FAILURES, lost_node_error, with_departure
from ._memory import DaskMemory
from ._placement import node_resource
from ._plugin import (
    WorkerStates,
    call_on_node,
    drop_session,
    install_snapshot,
    register_workspaces,
    wait_for_steps,
)
from ._worker_process import quiet_compute_failures

T = TypeVar("T")

logger = logging.getLogger("daskjobs")


def _keep_group() -> None:
    """The anchor task of a session: its result (``None``) is held while the session is open."""


class DaskSession(SchedulerConnection, Session):
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
        self._span_trim = SpanTrim(client)
        self._interrupted = False
        """A run was interrupted while it gathered: its steps may still run (see :meth:`start_job_run`)."""
        self._memory: DaskMemory | None = None
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

    @property
    def memory(self) -> DaskMemory:
        """Tier 0 on this cluster: node snapshots held as Dask data of this session's client, in the
        memory of the nodes' workers and of their peers (see ``MultiNodeCheckpointManager(in_memory=True)``)."""
        if self._memory is None:
            self._memory = DaskMemory(
                self._client, self.session_id, self._workers, lambda: self._placer.placement, self._restore_snapshots
            )
        return self._memory

    def _restore_snapshots(self, sources: Mapping[str, Future]) -> None:
        """Make each node's workspace a copy of its snapshot in the tier-0 bundle future ``sources[node]``,
        on its worker (a fresh workspace: a new token); a lost worker raises :class:`NodeLostError`."""
        self._check_client()
        self._preflight(list(sources), {})
        prefix = f"daskjobs-{self.session_id}-tier0-restore-{uuid.uuid4().hex[:8]}"
        futures: dict[str, Future] = {}
        node_of: dict[str, str] = {}
        for node, snapshot in sources.items():
            key = f"{prefix}-{node}"
            futures[key] = self._client.submit(
                install_snapshot,
                self._states,
                node,
                snapshot,
                key=key,
                resources={node_resource(node): 1},
                pure=False,
            )
            node_of[key] = node
        keys = list(futures)
        try:
            tokens = self._settle_and_gather(futures, node_of, keys)
        except RunFailed as failed:
            if isinstance(failed.error, NodeLostError):
                self._lost_once(failed.error)
            raise failed.error from None
        self._tokens.update({node_of[key]: token for key, token in zip(keys, tokens, strict=True)})

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
        futures = submit_graph(self._client, graph)
        trim_key_cache()
        if meanwhile is not None:
            meanwhile()
        results = self._settle_and_gather(futures, node_of, list(graph.result_keys.values()))
        self._span_trim.submitted(len(graph.tasks))  # once the scheduler answered: it is there to ask
        return dict(zip(graph.result_keys, results, strict=True))

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
            if self._memory is not None:
                self._memory.release_all()
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
        """Gather ``keys`` in one transfer once they are done, watching for lost nodes (see :func:`~._futures.settle`).

        On failure raise :class:`RunFailed` with the run's first error, with its remote traceback,
        and the results of the nodes whose key finished; distributed's failures become
        NodeLostError, and a broken scheduler connection a lost session unless the client
        reconnects within ``daskjobs.connect-timeout``.
        """
        try:
            settled = settle(self._client, futures, node_of, keys, self._workers, self._placer.gone)
        except (KeyboardInterrupt, SystemExit):  # the run's steps may run on: the next run waits for them
            self._interrupted = True
            raise
        if not isinstance(settled, Failure):
            return settled
        error, tb, partial = settled.error, settled.traceback, settled.finished
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
