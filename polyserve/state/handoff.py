"""What the master hands each worker at its fork: set once in the worker, read by polyserve.host.

The master sets up the usage table and the fork server before it forks; a worker learns
about them from this one frozen record, which gunicorn's post_fork hook
(polyserve/master/hooks.py) sets in the new worker. No worker module imports the master:
polyserve/host.py reads the record and passes on what each object needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from polyserve.state.shm import Table


@dataclass(frozen=True)
class Handoff:
    """The master's table, this worker's row in it, and the fork server's socket name."""

    table: Table
    row: int
    forkserver: str | None  # None where the master runs no fork server


_received: Handoff | None = None


def hand(handoff: Handoff) -> None:
    """Record what the master hands this worker: post_fork calls it once, in the worker."""
    global _received
    _received = handoff


def received() -> Handoff | None:
    """What the master handed this worker; None without a polyserve master (in-process tests)."""
    return _received
