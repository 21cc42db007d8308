"""Sessions: where TaskGroups run, and where node workspaces live.

:class:`LocalSession` runs the lowered graphs in this process (:mod:`._local`);
:class:`DaskSession` on a ``distributed`` cluster (:mod:`._dask`, with its client
:mod:`._client` and :mod:`._address`, its hold on the scheduler :mod:`._connection`, a run's
futures submitted and settled :mod:`._futures`, the worker side :mod:`._plugin`, placement by
resources :mod:`._placement` on pinned and pool workers and as the cluster shrinks and grows
:mod:`._elastic`, lost nodes and planned departures :mod:`._losses`); :func:`node_cluster`
starts a local cluster with one worker per node (:mod:`._cluster`, :mod:`._worker_process`), and
:func:`._pool.pool_cluster` one of pool workers.

The only package that imports ``distributed``. It imports the model and the execution layer
(:mod:`daskjobs._execution`); the runner and the checkpoint managers use sessions (the managers
for type hints only).
"""

from __future__ import annotations

from distributed import Client

from ._base import Session
from ._cluster import node_cluster
from ._dask import DaskSession
from ._local import LocalSession
from ._placement import node_resource

__all__ = ["DaskSession", "LocalSession", "Session", "as_session", "node_cluster", "node_resource"]


def as_session(obj: Session | Client | str | None) -> Session:
    """The session for ``obj``: what APIs that take "a session" accept.

    ``None`` gives a new :class:`LocalSession`, a :class:`Session` is returned as is, and a
    ``distributed.Client``, a cluster object or a scheduler address gives a new
    :class:`DaskSession` on it. A session made here is owned by the caller, who closes it
    (closing it never closes a client passed in).

    Examples
    --------
    >>> import daskjobs as dj
    >>> session = as_session(None)
    >>> type(session).__name__
    'LocalSession'
    >>> as_session(session) is session
    True
    >>> session.close()
    """
    if obj is None:
        return LocalSession()
    if isinstance(obj, Session):
        return obj
    return DaskSession(obj)
