"""Placement decisions (SPEC §1.6a), as pure functions of a worker table: pinned nodes stay on their
workers, the others are spread over the pool by nodes per thread, meeting their demands, and stay
where they are; resources of closed sessions are stale; workers that join even the spread out."""

from __future__ import annotations

import dask.config
import pytest

import daskjobs as dj
from daskjobs._config import check_config, config_choice
from daskjobs.errors import ConfigError
from daskjobs.session._placement import Assignment, Survey, assign, placement_error, plan_moves


def worker(name: str, nthreads: int = 1, **resources: float) -> tuple[str, dict]:
    return f"tcp://{name}:1", {"name": name, "nthreads": nthreads, "resources": dict(resources)}


def table(*workers: tuple[str, dict]) -> dict[str, dict]:
    return dict(workers)


def pinned(node: str, amount: float = 2) -> dict[str, float]:
    return {dj.node_resource(node): amount}


def test_nodes_are_spread_over_the_pool_by_nodes_per_thread():
    """Five nodes over a worker of 2 threads and two of 1 thread: 3, 1 and 1 (1.5 nodes per thread at
    most; any other split puts 2 nodes on a 1-thread worker)."""
    workers = table(worker("a", 2), worker("b"), worker("c"))
    done = assign(Survey(workers), ["n0", "n1", "n2", "n3", "n4"], {}, {}, "s")
    per_worker = {}
    for node, address in done.placement.items():
        per_worker.setdefault(address, []).append(node)
    assert {a: len(n) for a, n in per_worker.items()} == {"tcp://a:1": 3, "tcp://b:1": 1, "tcp://c:1": 1}
    assert done.pooled == {"n0", "n1", "n2", "n3", "n4"}
    assert done.problems == {}


def test_pinned_nodes_stay_and_count_in_the_spread():
    """A worker started for node ``p`` serves it (and nothing else); its node counts: the pool's two
    workers take the other nodes, one each."""
    workers = table(worker("pin", 2, **pinned("p")), worker("a"), worker("b"))
    done = assign(Survey(workers), ["p", "x", "y"], {}, {}, "s")
    assert done.placement == {"p": "tcp://pin:1", "x": "tcp://a:1", "y": "tcp://b:1"}
    assert done.pooled == {"x", "y"}


def test_demands_are_met_and_placed_first():
    """A node needing ``GPU=1`` goes to the worker that has it, before the others fill the pool."""
    workers = table(worker("cpu", 4), worker("gpu", 1, GPU=1))
    done = assign(Survey(workers), ["a", "b", "g"], {"g": {"GPU": 1}}, {}, "s")
    assert done.placement["g"] == "tcp://gpu:1"
    assert done.placement["a"] == done.placement["b"] == "tcp://cpu:1"


def test_a_node_stays_on_its_worker_while_it_lives():
    """Where the session's pool node is now wins over a better spread: a node moves only when its
    worker leaves (or, at an epoch boundary, when workers joined)."""
    workers = table(worker("a"), worker("b"))
    current = {"x": "tcp://a:1", "y": "tcp://a:1"}
    done = assign(Survey(workers), ["x", "y"], {}, current, "s")
    assert done.placement == current
    left = table(worker("b"))
    again = assign(Survey(left), ["x", "y"], {}, current, "s")
    assert again.placement == {"x": "tcp://b:1", "y": "tcp://b:1"}


@pytest.mark.parametrize(
    ("workers", "demands", "why"),
    [
        (table(), {}, "no worker is left on the cluster"),
        (
            table(worker("pin", 2, **pinned("p"))),
            {},
            "no worker provides 'daskjobs-node-x', and every worker is pinned to other nodes (no pool worker)",
        ),
        (table(worker("a")), {"x": {"GPU": 1}}, "no worker provides 'daskjobs-node-x', and no pool worker has GPU=1"),
        (
            table(worker("p1", 2, **pinned("x")), worker("p2", 2, **pinned("x"))),
            {},
            "2 workers provide it ('p1', 'p2'); a node needs exactly one worker",
        ),
        (table(worker("pin", 2, **pinned("x"))), {"x": {"GPU": 1}}, "its worker 'pin' lacks GPU=1"),
    ],
    ids=["empty", "all-pinned", "demand", "two-pinned", "pinned-lacks"],
)
def test_a_node_that_cannot_be_placed_says_why(workers, demands, why):
    """Each way a node cannot be placed has its own reason; the error lists the nodes with their
    demands and the workers, and says how to add a worker."""
    survey = Survey(workers)
    done = assign(survey, ["x"], demands, {}, "s")
    assert done.problems == {"x": why}
    error = placement_error(done.problems, survey, demands, " (waited 2 s)")
    assert error.nodes == ["x"]
    needs = " (needs GPU=1)" if demands else ""
    assert f"node 'x'{needs}: {why}" in str(error)
    assert "cannot place node(s) ['x'] on the Dask cluster (waited 2 s)" in str(error)
    assert "daskjobs worker SCHEDULER_ADDRESS --node x" in str(error)


def test_resources_given_by_a_closed_session_are_stale():
    """A worker holding a node resource that a session gave is a pool worker; one whose giver is
    closed (a driver that died) holds it stale and takes other nodes as if free, while a resource
    nobody gave is pinned."""
    resource = dj.node_resource("x")
    workers = table(worker("a", **{resource: 1}), worker("b", **pinned("p")))
    given = {"tcp://a:1": {resource: ["dead"]}}
    survey = Survey(workers, given, frozenset({"me"}))
    assert survey.held("tcp://a:1") == {"x": "stale"}
    assert survey.held("tcp://b:1") == {"p": "pinned"}
    assert survey.pool() == ["tcp://a:1"]
    done = assign(survey, ["x", "y"], {}, {}, "me")
    assert done.placement == {"x": "tcp://a:1", "y": "tcp://a:1"}
    open_survey = Survey(workers, given, frozenset({"me", "dead"}))
    assert open_survey.held("tcp://a:1") == {"x": "given"}


def test_workers_that_join_even_out_the_spread():
    """Four nodes on one worker; two workers join: two nodes move, one to each, and nothing moves when
    the spread is even."""
    workers = table(worker("a"), worker("b"), worker("c"))
    current = dict.fromkeys(["n0", "n1", "n2", "n3"], "tcp://a:1")
    moves = plan_moves(Survey(workers), Assignment(current, set(current)), {})
    assert sorted(moves.values()) == ["tcp://b:1", "tcp://c:1"]
    moved = {**current, **moves}
    assert plan_moves(Survey(workers), Assignment(moved, set(moved)), {}) == {}


def test_only_pool_nodes_move_and_only_where_they_fit():
    """A pinned node never moves, and a node needing a GPU moves only to a worker that has one."""
    workers = table(worker("a", **pinned("p")), worker("g", GPU=1), worker("new"))
    current = {"p": "tcp://a:1", "g1": "tcp://g:1", "g2": "tcp://g:1"}
    moves = plan_moves(Survey(workers), Assignment(current, {"g1", "g2"}), {"g1": {"GPU": 1}, "g2": {"GPU": 1}})
    assert moves == {}
    moves = plan_moves(Survey(workers), Assignment(current, {"g1", "g2"}), {"g1": {"GPU": 1}})
    assert moves == {"g2": "tcp://new:1"}


def test_rebalance_is_dask_config():
    """``daskjobs.rebalance`` is ``"on-join"`` by default or ``"never"``; another value is a ConfigError
    naming the key, before a run starts."""
    assert config_choice("rebalance") == "on-join"
    with dask.config.set({"daskjobs.rebalance": "never"}):
        assert config_choice("rebalance") == "never"
    with dask.config.set({"daskjobs.rebalance": "always"}), pytest.raises(ConfigError) as info:
        check_config()
    assert str(info.value) == "daskjobs.rebalance is 'always': it must be 'on-join' or 'never' (default 'on-join')"
