"""Session workspace access (§1.6): which node ``fetch``/``feed``/``blobs`` target, and that reading creates nothing."""

from __future__ import annotations

import numpy as np
import pytest

import daskjobs as dj
from daskjobs import errors


def test_fresh_session_uses_the_default_node():
    """A session that knows no node yet feeds, fetches and lists on the current node, "local"."""
    with dj.LocalSession() as session:
        assert session.blobs() == []
        with pytest.raises(KeyError, match=r"'x' is not in the workspace of node 'local'"):
            session.fetch("x")
        assert session.nodes() == []
        session.feed("x", np.arange(3))
        assert session.nodes() == ["local"]
        np.testing.assert_array_equal(session.fetch("x"), np.arange(3))
        assert session.blobs() == ["x"]
        assert session.blobs(node="local") == ["x"]


def test_fresh_session_uses_the_current_node():
    """Inside ``with dj.Node("a")`` a session that knows no node yet targets "a"."""
    with dj.LocalSession() as session:
        with dj.Node("a"):
            session.feed("x", 1.5)
        assert session.nodes() == ["a"]
        assert session.fetch("x") == 1.5


def test_read_only_calls_do_not_create_node_state():
    """blobs() and fetch() of a node without a workspace create none: calls without node= keep working."""
    with dj.LocalSession() as session:
        session.run(lambda ws: ws.__setitem__("x", 7))
        assert session.blobs(node="typo") == []
        with pytest.raises(KeyError, match=r"'x' is not in the workspace of node 'typo'.*\['local'\]"):
            session.fetch("x", node="typo")
        assert session.nodes() == ["local"]
        assert session.fetch("x") == 7
        assert session.blobs() == ["x"]


def test_several_nodes_need_a_node_name():
    """With several nodes, omitting node= raises a JobDefinitionError (a ValueError) listing them."""
    with dj.LocalSession() as session:
        session.feed("x", 1, node="a")
        session.feed("x", 2, node="b")
        for call in (lambda: session.fetch("x"), lambda: session.feed("y", 3), session.blobs):
            with pytest.raises(errors.JobDefinitionError, match=r"nodes \['a', 'b'\]; name the node"):
                call()
        assert session.fetch("x", node="b") == 2


def test_reading_an_unused_node(session):
    """Reading a valid node that holds nothing gives no blobs and a KeyError, on every session kind."""
    session.feed("x", 1, node="a")
    assert session.blobs(node="c") == []
    with pytest.raises(KeyError, match="'y'"):
        session.fetch("y", node="c")
    assert session.fetch("x", node="a") == 1
    assert session.blobs(node="a") == ["x"]
