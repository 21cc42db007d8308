"""Tier 0 on a Dask cluster: node snapshots held as Dask data in the workers' memory (SPEC §3).

On a worker, :class:`WorkerMemory` (one per worker process, in the workspace plugin) takes the
snapshot a node's epoch hook made and puts it into the worker's data with
``Worker.update_data``, which tells the scheduler nothing (a released key turned into memory is
Dask's scatter path); it then sends the replicas to their peers the same way (one message per
peer for every snapshot waiting, on the worker's event loop, while the next epoch runs) and last
registers the keys with the scheduler as data of the driver's client (``update_data``), replicas
first: a registration that names a peer which left meanwhile fails before the node's own key is
touched, and the own key is then registered alone. A push still running after
:data:`_PUSH_GRACE` (a peer that died: Dask retries the connection until its connect timeout) does
not hold the own keys back: they are registered without its replicas, which are registered once
the push ends, or reported failed. From then on they are ordinary Dask data: released with the
driver's client, moved off a worker that retires gracefully, lost with their last holder, never
recomputed (they have no task).

On the driver, :class:`DaskMemory` holds a ``distributed.Future`` per key from before the key
exists: the scheduler's report of the registration finishes it, so the driver knows which
snapshots are stored without asking. A key released before its registration arrived is released
again at every release from a second later on, and every :data:`_RELEASE_LATE_EVERY` seconds, for
:data:`_LATE_FOR` seconds. Restoring is a task per node on its worker with the snapshot's future
as argument: Dask brings the snapshot there if another worker holds it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import dask.config
from dask.typing import Key
from distributed import Client, Future, Worker
from distributed.protocol.serialize import to_serialize
from distributed.worker_state_machine import FreeKeysEvent

from .._config import config_timeout
from .._execution.memory import Bundle, HeldBundle, KeepOrder, Kept, PushFailure
from .._model.values import Value, copy_value
from ..errors import CheckpointWriteError
from ._placement import live_workers

logger = logging.getLogger("daskjobs")

_RELEASE_AGAIN_AFTER = 1.0
"""Seconds after which a key released before its registration arrived is released once more."""
_LATE_FOR = 90.0
"""Seconds during which such a key is released again: a registration can come that
late (a worker's push to a peer that died waits for Dask's connect timeout before the worker
registers the replicas it did send)."""
_RELEASE_LATE_EVERY = 5.0
"""Seconds between the releases of such keys that the driver makes on its own, while any may still
come (a run that ended makes no more releases for them to ride on)."""
_PUSH_GRACE = 1.0
"""Seconds a worker waits for its pushes to peers before it registers its own snapshots without
them; the replicas still in flight are registered once sent."""


@dataclass(frozen=True)
class _Sealed:
    """A bundle completed on this worker: the order of one of its nodes, its nodes, their snapshots' bytes."""

    order: KeepOrder
    nodes: tuple[str, ...]
    nbytes: int


def _address(worker: Worker) -> str:
    return str(worker.contact_address or worker.address)


class WorkerMemory:
    """The tier-0 snapshots of the nodes a worker serves (see the module docstring).

    :meth:`keep` is called from a node's epoch task (a thread): it adds the snapshot to its bundle,
    and the node that completes the bundle hands it to the worker's event loop, which stores it,
    sends its replicas and registers it.
    """

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._lock = threading.Lock()
        self._open: dict[str, tuple[KeepOrder, dict[str, dict[str, Value]], int]] = {}
        """Bundle key -> an order of it, the snapshots in it so far, their bytes."""
        self._sealed: list[tuple[KeepOrder, dict[str, dict[str, Value]], int]] = []
        self._failed: dict[str, list[PushFailure]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._memory: tuple[float, int] = (-1.0, 0)

    # -- from a node's task ---------------------------------------------------------------
    def check_fits(self, order: KeepOrder, nbytes: int) -> None:
        """Raise :class:`CheckpointWriteError` when a snapshot of ``nbytes`` and as many bytes of
        replicas as ``order`` sends (this worker holds about as many of its peers' replicas) would
        take the worker past the memory fraction at which Dask pauses it (``distributed.worker.memory.pause``,
        else 95 % of its memory limit)."""
        manager = getattr(self._worker, "memory_manager", None)
        limit = getattr(manager, "memory_limit", None)
        if not limit:
            return
        fraction = dask.config.get("distributed.worker.memory.pause", default=0.8) or 0.95
        needed = nbytes * (1 + len(order.replicas))
        used = self._process_memory()
        if used + needed > fraction * limit:
            raise CheckpointWriteError(
                f"node {order.node!r}, epoch {order.epoch}: its tier-0 snapshot ({nbytes} bytes) and "
                f"{len(order.replicas)} replica(s) of that size do not fit in the memory of worker "
                f"{_address(self._worker)}: {used} bytes in use, limit {int(limit)} bytes, of which Dask lets "
                f"{fraction:.0%} be used; give the workers more memory (--memory-limit), or keep fewer replicas "
                "(replicas=...), or turn tier 0 off (in_memory=False)"
            )

    def _process_memory(self) -> int:
        """The process's memory (RSS), read at most every 50 ms (reading it costs a system call)."""
        at, used = self._memory
        if time.monotonic() - at > 0.05:
            used = int(self._worker.monitor.get_process_memory())
            self._memory = (time.monotonic(), used)
        return used

    def keep(self, order: KeepOrder, snapshot: dict[str, Value], nbytes: int) -> Kept:
        """Add ``snapshot`` to its bundle (kept only where the bundle was planned)."""
        me = _address(self._worker)
        if order.holder != me:  # the node moved after its bundle was planned: not kept
            return {"bytes": nbytes, "holder": ""}
        with self._lock:
            for key in [k for k, (o, _, _) in self._open.items() if o.owner == order.owner and o.epoch < order.epoch]:
                del self._open[key]  # a bundle an earlier epoch never completed (a node's task failed)
            _, snapshots, total = self._open.get(order.key, (order, {}, 0))
            snapshots[order.node] = snapshot
            total += nbytes
            full = len(snapshots) >= order.size
            if full:
                self._open.pop(order.key, None)
                self._sealed.append((order, snapshots, total))
            else:
                self._open[order.key] = (order, snapshots, total)
        if full:
            self._worker.loop.add_callback(self._start)
        return {"bytes": nbytes, "holder": me}

    def failures(self, node: str) -> list[PushFailure]:
        with self._lock:
            return self._failed.pop(node, [])

    # -- on the event loop ----------------------------------------------------------------
    def _start(self) -> None:
        self._spawn(self._store())

    async def _store(self) -> None:
        with self._lock:
            sealed, self._sealed = self._sealed, []
        if not sealed:
            return
        worker, me = self._worker, _address(self._worker)
        bundles: dict[Key, object] = {order.key: HeldBundle(snapshots, total) for order, snapshots, total in sealed}
        worker.update_data(data=bundles, stimulus_id=_stimulus())
        by_peer: dict[str, dict[str, Any]] = {}
        for order, _, _ in sealed:
            for key, peer in order.replicas.items():
                by_peer.setdefault(peer, {})[key] = to_serialize(bundles[order.key])
        pushes = {peer: asyncio.ensure_future(self._push(peer, data)) for peer, data in sorted(by_peer.items())}
        if pushes:
            await asyncio.wait(pushes.values(), timeout=_PUSH_GRACE)
        failed: dict[str, BaseException] = {}
        for peer, push in pushes.items():
            error = push.result() if push.done() else None
            if error is not None:
                failed[peer] = error
        complete = [_Sealed(order, tuple(snapshots), total) for order, snapshots, total in sealed]
        for bundle in complete:
            for peer in sorted(set(bundle.order.replicas.values()) & set(failed)):
                self._fail(bundle, peer, failed[peer])
        late = {peer: push for peer, push in pushes.items() if not push.done()}
        for owner in sorted({bundle.order.owner for bundle in complete}):
            mine = [bundle for bundle in complete if bundle.order.owner == owner]
            await self._register(owner, mine, me, set(failed) | set(late))
            for peer, push in late.items():
                self._spawn(self._register_late(owner, mine, peer, push))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _register_late(
        self, owner: str, sealed: list[_Sealed], peer: str, push: asyncio.Future[BaseException | None]
    ) -> None:
        """Register the replicas of ``sealed`` on ``peer`` once their push, slower than
        :data:`_PUSH_GRACE`, ended (the own snapshots were registered without them)."""
        error = await push
        replicas = {key: [peer] for bundle in sealed for key, at in bundle.order.replicas.items() if at == peer}
        if error is None and replicas:
            nbytes = {key: bundle.nbytes for bundle in sealed for key in bundle.order.replicas if key in replicas}
            try:
                await self._worker.scheduler.update_data(who_has=replicas, nbytes=nbytes, client=owner)
            except Exception as exc:
                error = exc
        if error is not None:
            for bundle in sealed:
                if peer in bundle.order.replicas.values():
                    self._fail(bundle, peer, error)

    async def _push(self, peer: str, data: dict[str, Any]) -> BaseException | None:
        """Send ``data`` (key -> serialised bundle) into ``peer``'s memory; the error, if it failed."""
        try:
            await asyncio.wait_for(
                self._worker.rpc(peer).update_data(data=data, stimulus_id=_stimulus()),
                config_timeout("connect-timeout"),
            )
        except Exception as exc:
            return exc
        return None

    async def _register(self, owner: str, sealed: list[_Sealed], me: str, failed: set[str]) -> None:
        """Register the bundles of ``sealed`` (and their replicas, those sent) as ``owner``'s data: in
        one call to the scheduler when the replicas went to one peer (the usual ring), else one per peer.

        The scheduler's ``update_data`` fails on a worker it no longer knows, after creating the key it
        was to hold there and before it registers anything for the client: so the replicas come
        first, and after such a failure the own keys are registered alone."""
        scheduler = self._worker.scheduler
        own = {bundle.order.key: [me] for bundle in sealed}
        nbytes = {key: bundle.nbytes for bundle in sealed for key in bundle.order.all_keys()}
        by_peer: dict[str, dict[str, list[str]]] = {}
        for bundle in sealed:
            for key, peer in bundle.order.replicas.items():
                if peer not in failed:
                    by_peer.setdefault(peer, {})[key] = [peer]
        calls = [{**next(iter(by_peer.values()), {}), **own}] if len(by_peer) <= 1 else [*by_peer.values(), own]
        for who_has in calls:
            try:
                await scheduler.update_data(who_has=who_has, nbytes={k: nbytes[k] for k in who_has}, client=owner)
            except Exception as exc:
                replicas = [key for key in who_has if key not in own]
                for bundle in sealed:  # a peer left after it took the replicas: they went with it
                    for key in set(bundle.order.replicas) & set(replicas):
                        self._fail(bundle, bundle.order.replicas[key], exc)
                if not replicas:
                    self._unregistered(list(own), exc)
                elif len(calls) == 1:
                    calls.append(own)

    def _unregistered(self, keys: list[str], error: BaseException) -> None:
        """The own keys could not be registered: nothing would ever release them, so they go here."""
        closing = str(getattr(self._worker.status, "name", self._worker.status)) in ("closing", "closed")
        log = logger.debug if closing else logger.warning
        log("could not register tier-0 snapshots %s with the scheduler: %r", sorted(keys), error)
        if not closing:
            _forget(self._worker, keys)

    def _fail(self, bundle: _Sealed, peer: str, error: BaseException) -> None:
        """Every node of ``bundle`` hears, at its next hook, that its replica on ``peer`` failed."""
        for node in bundle.nodes:
            self._record_failure(node, bundle.order.epoch, peer, error)

    def _record_failure(self, node: str, epoch: int, peer: str, error: BaseException) -> None:
        left = isinstance(error, OSError | asyncio.TimeoutError | KeyError)
        failure: PushFailure = {"epoch": epoch, "peer": peer, "error": repr(error), "fatal": not left}
        with self._lock:
            self._failed.setdefault(node, []).append(failure)


def _stimulus() -> str:
    return f"daskjobs-tier0-{time.time()}"


def _forget(worker: Worker, keys: list[str]) -> None:
    """Drop keys this worker holds that the scheduler never knew (it hears of it, and ignores it)."""
    worker.handle_stimulus(FreeKeysEvent(keys=keys, stimulus_id=_stimulus()))


class DaskMemory:
    """The driver's side of tier 0 on a DaskSession (see the module docstring).

    ``workers`` gives the scheduler's worker table (asked afresh), ``placement`` the node -> worker
    placement, and ``restore(sources)`` installs node workspaces from snapshot futures.
    """

    def __init__(
        self,
        client: Client,
        session_id: str,
        workers: Callable[[], Mapping[str, Any]],
        placement: Callable[[], Mapping[str, str]],
        restore: Callable[[Mapping[str, Future]], None],
    ) -> None:
        self._client, self._session = client, session_id
        self._workers, self._placement, self._restore = workers, placement, restore
        self.owner = str(client.id)
        self._lock = threading.Lock()
        self._futures: dict[str, Future] = {}
        self._late: dict[str, float] = {}
        self._live: tuple[float, list[str]] = (-1.0, [])
        self._waiting: set[asyncio.Task[None]] = set()
        self._late_timer = False

    # -- bundles --------------------------------------------------------------------------
    def forget_workers(self) -> None:
        """Ask the scheduler for its workers again before choosing the next peers (after a loss)."""
        self._live = (-1.0, [])

    def live_workers(self) -> list[str]:
        """The workers that may hold replicas, as seen at most a few seconds ago."""
        seen, live = self._live
        if time.monotonic() - seen > 5.0:
            table = live_workers(self._workers())
            live = sorted(a for a, info in table.items() if info.get("status") != "closing_gracefully")
            self._live = (time.monotonic(), live)
        return live

    def bundles(self, epoch: int, save_id: str, nodes: Sequence[str], replicas: int) -> list[Bundle]:
        """One bundle per worker serving some of ``nodes`` (as placed now), replicated on the
        ``replicas`` workers after it in the ring of workers (fewer when the cluster has fewer)."""
        live = self.live_workers()
        placement = self._placement()
        by_worker: dict[str, list[str]] = {}
        for node in nodes:
            by_worker.setdefault(placement.get(node, ""), []).append(node)
        made: list[Bundle] = []
        for index, (holder, served) in enumerate(sorted(by_worker.items())):
            start = live.index(holder) + 1 if holder in live else 0
            ring = [live[(start + i) % len(live)] for i in range(len(live))]
            peers = [a for a in ring if a != holder][:replicas]
            key = f"daskjobs-{self._session}-tier0-{epoch}-{save_id[:8]}-{index}"
            made.append(Bundle(f"{key}-0", holder, tuple(served), {f"{key}-{i + 1}": p for i, p in enumerate(peers)}))
        return made

    # -- keys -----------------------------------------------------------------------------
    def hold(self, keys: Iterable[str]) -> None:
        made: dict[str, Future] = {key: Future(key, self._client) for key in keys}
        with self._lock:
            self._futures.update(made)

    def registered(self, keys: Iterable[str]) -> dict[str, bool]:
        with self._lock:
            return {key: key in self._futures and self._futures[key].status != "pending" for key in keys}

    def release_when_held(self, keys: Iterable[str], older: Iterable[str]) -> None:
        """Release ``older`` as soon as every key of ``keys`` is registered (on the client's event loop,
        when the scheduler's reports arrive); not when one of ``keys`` is released first."""
        with self._lock:
            futures = [self._futures[key] for key in keys if key in self._futures]
        superseded = list(older)
        if not futures or not superseded:
            return

        async def wait() -> None:
            for future in futures:  # a future released meanwhile is cancelled, which ends the wait
                if future._state is not None:
                    await future._state.wait()
            if all(future.status == "finished" for future in futures):
                self.release(superseded)

        def start() -> None:
            task = asyncio.ensure_future(wait())
            self._waiting.add(task)
            task.add_done_callback(self._waiting.discard)

        if self._client.loop is not None:
            self._client.loop.add_callback(start)

    def holders(self, keys: Iterable[str]) -> dict[str, list[str]]:
        client, keys = self._client, list(keys)
        if client.scheduler is None:
            return {key: [] for key in keys}
        found = client.sync(client.scheduler.who_has, keys=keys, callback_timeout=config_timeout("connect-timeout"))
        return {key: list(found.get(key) or ()) for key in keys}

    def release(self, keys: Iterable[str]) -> None:
        now = time.monotonic()
        with self._lock:
            released = [self._futures.pop(key) for key in keys if key in self._futures]
            self._late.update({str(f.key): now for f in released if f.status == "pending"})
            again = [k for k, at in self._late.items() if now - at >= _RELEASE_AGAIN_AFTER]
            self._late = {k: at for k, at in self._late.items() if now - at < _LATE_FOR}
        released.clear()  # the futures go: their keys are released
        if again and self._client.status == "running":
            self._client._send_to_scheduler({"op": "client-releases-keys", "keys": again, "client": self.owner})
        self._release_late_later()

    def _release_late_later(self) -> None:
        """While keys may still be registered late, release them again every
        :data:`_RELEASE_LATE_EVERY` seconds on the client's event loop."""
        loop = self._client.loop
        with self._lock:
            if not self._late or self._late_timer or loop is None or self._client.status != "running":
                return
            self._late_timer = True

        def again() -> None:
            with self._lock:
                self._late_timer = False
            self.release([])

        loop.add_callback(lambda: loop.call_later(_RELEASE_LATE_EVERY, again))

    def release_all(self) -> None:
        """Release every key this driver holds (the session closes)."""
        with self._lock:
            held = list(self._futures)
        self.release(held)
        with self._lock:
            self._late = {k: t - _RELEASE_AGAIN_AFTER for k, t in self._late.items()}
        self.release([])

    def restore(self, sources: Mapping[str, str]) -> None:
        with self._lock:
            missing = [key for key in sources.values() if key not in self._futures]
            futures = {node: self._futures.get(key) for node, key in sources.items()}
        if missing:
            raise KeyError(f"tier-0 snapshots {missing} are not held by this session")
        self._restore({node: future for node, future in futures.items() if future is not None})


class ProcessMemory:
    """Tier 0 in one process (a LocalSession): each snapshot is a copy kept here; no replicas.

    It is both the nodes' keeper and the driver's side; ``states`` gives a node's state to restore.
    """

    owner = ""

    def __init__(self, restore: Callable[[str, dict[str, Value]], None]) -> None:
        self._lock = threading.Lock()
        self._kept: dict[str, dict[str, dict[str, Value]]] = {}
        self._restore = restore
        self._id = uuid.uuid4().hex[:8]

    def bundles(self, epoch: int, save_id: str, nodes: Sequence[str], replicas: int) -> list[Bundle]:
        """One bundle per node, kept in this process (no replicas)."""
        key = f"daskjobs-{self._id}-tier0-{epoch}-{save_id[:8]}"
        return [Bundle(f"{key}-{node}", "this process", (node,)) for node in nodes]

    def check_fits(self, order: KeepOrder, nbytes: int) -> None:
        """A copy in this process always fits (the process has no memory limit of Dask's)."""

    def keep(self, order: KeepOrder, snapshot: dict[str, Value], nbytes: int) -> Kept:
        with self._lock:
            self._kept[order.key] = {order.node: snapshot}
        return {"bytes": nbytes, "holder": "this process"}

    def failures(self, node: str) -> list[PushFailure]:
        return []

    def forget_workers(self) -> None:
        """Nothing to forget: the process is the only holder."""

    def hold(self, keys: Iterable[str]) -> None:
        """The snapshots are kept here as the nodes make them."""

    def registered(self, keys: Iterable[str]) -> dict[str, bool]:
        with self._lock:
            return {key: key in self._kept for key in keys}

    def holders(self, keys: Iterable[str]) -> dict[str, list[str]]:
        with self._lock:
            return {key: ["this process"] if key in self._kept else [] for key in keys}

    def release(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                self._kept.pop(key, None)

    def release_when_held(self, keys: Iterable[str], older: Iterable[str]) -> None:
        """Release ``older`` now if every key of ``keys`` is kept (a snapshot is kept as it is made)."""
        if all(self.registered(keys).values()):
            self.release(older)

    def restore(self, sources: Mapping[str, str]) -> None:
        for node, key in sources.items():
            with self._lock:
                snapshot = self._kept[key][node]
            self._restore(node, {name: copy_value(value, name) for name, value in snapshot.items()})
