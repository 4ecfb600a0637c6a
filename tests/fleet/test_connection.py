"""The fleet's database connection against a real PostgreSQL: reconnects, deadlines, forks."""

from __future__ import annotations

import multiprocessing
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from polyserve.fleet.connection import Connection, Unreachable
from tests.fleet.test_fleet_faults import stall
from tests.helpers import until
from tests.postgres import PostgresServer, terminate_backends


@pytest.fixture
def connections() -> Iterator[Callable[[str, float], Connection]]:
    """Connection(url, timeout_s), each closed when the test ends."""
    made: list[Connection] = []

    def make(url: str, timeout_s: float) -> Connection:
        made.append(Connection(url, timeout_s=timeout_s))
        return made[-1]

    yield make
    for db in made:
        db.close()


def backends(url: str) -> list[int]:
    with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
        return [row[0] for row in conn.execute("SELECT pid FROM pg_stat_activity")]


def backend_pid(db: Connection) -> int:
    with db.session() as conn:
        row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def test_a_call_after_its_backend_was_terminated_reconnects(fleet_db, connections):
    """The server closed the kept connection between calls: the next call finds out
    before its statement and connects again, instead of failing."""
    db = connections(fleet_db, 5)
    first = backend_pid(db)
    assert terminate_backends(fleet_db) == [first]
    until(lambda: first not in backends(fleet_db), what="the backend to exit")
    second = backend_pid(db)
    assert second != first


def test_a_call_after_the_server_restarted_reconnects(own_postgres: PostgresServer, connections):
    db = connections(own_postgres.create_database(), 5)
    first = backend_pid(db)
    own_postgres.stop()
    own_postgres.start()
    assert backend_pid(db) != first


def test_a_call_that_ended_keeps_its_connection_past_its_deadline(fleet_db, connections):
    """A deadline that comes up after its call ended breaks nothing: the connection of
    many short calls outlives all their deadlines."""
    db = connections(fleet_db, 0.3)
    pids = {backend_pid(db) for _ in range(50)}
    time.sleep(1.0)  # every one of those deadlines has passed
    pids.add(backend_pid(db))
    assert len(pids) == 1, pids


def test_a_call_to_a_stalled_server_is_unreachable(own_postgres: PostgresServer, connections):
    """A server that stops answering without closing (SIGSTOP): the call's socket is
    broken at its deadline and the call raises Unreachable; the next call after the
    server is back connects again."""
    db = connections(own_postgres.create_database(), 1.0)
    backend_pid(db)
    stall(own_postgres, signal.SIGSTOP)
    try:
        with pytest.raises(Unreachable), db.session() as conn:
            conn.execute("SELECT 1")
    finally:
        stall(own_postgres, signal.SIGCONT)
    assert backend_pid(db) > 0


def _child(url: str, ready: Any, stalled: Any, queue: Any) -> None:
    db = Connection(url, timeout_s=1.0)
    backend_pid(db)
    ready.set()
    stalled.wait(60)
    try:
        with db.session() as conn:
            conn.execute("SELECT 1")
        queue.put("answered")
    except Unreachable:
        queue.put("unreachable")
    db.close()


def test_a_forked_childs_calls_have_deadlines_of_their_own(
    own_postgres: PostgresServer, connections
):
    """A gunicorn worker is forked from a master that made calls: the parent's deadline
    thread is not in the child, which bounds its own calls all the same."""
    url = own_postgres.create_database()
    backend_pid(connections(url, 5))  # the parent's deadlines have their thread
    fork = multiprocessing.get_context("fork")
    ready, stalled, queue = fork.Event(), fork.Event(), fork.Queue()
    child = fork.Process(target=_child, args=(url, ready, stalled, queue))
    child.start()
    try:
        assert ready.wait(60)
        stall(own_postgres, signal.SIGSTOP)
        stalled.set()
        child.join(60)  # its one-second deadline, or never without a thread to keep it
    finally:
        stall(own_postgres, signal.SIGCONT)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert queue.get(timeout=5) == "unreachable"
