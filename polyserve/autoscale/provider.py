"""What every provider does: list, create, take out, stop and delete a pool's hosts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

# Every host a provider makes carries these, so list() finds its own and nothing else.
LABEL = "polyserve"  # label (Hetzner) / name prefix (RunPod, local) marking our hosts
POOL_LABEL = "polyserve-pool"


@dataclass(frozen=True)
class HostSpec:
    """What a new host is started with. `environment` holds secrets (the database URL):
    never log it."""

    pool: str
    host_id: str  # the id the host joins the fleet under: also the machine's name
    environment: dict[str, str] = field(repr=False)


@dataclass(frozen=True)
class Machine:
    """One host as its provider sees it."""

    id: str  # the provider's own id (a PID, a server id, a pod id)
    host_id: str  # the fleet id it was started with (POLYSERVE_HOST_ID)
    pool: str
    url: str  # where its host answers, "" while the provider does not know yet
    created_at: float  # unix seconds
    state: str = ""  # the provider's word for it (running, starting, off, …)


class Provider(Protocol):
    """A source of hosts. Calls block (the scaler runs them off its loop) and raise
    ProviderError when the provider refuses or cannot be reached."""

    name: str

    def list(self, pool: str) -> list[Machine]:
        """The pool's hosts this provider made and has not deleted, whatever their state."""
        ...

    def create(self, spec: HostSpec) -> Machine:
        """Start a host that joins the fleet with spec.environment."""
        ...

    def take_out(self, machine: Machine) -> None:
        """Stop new traffic from reaching it (a load balancer drops it); it keeps serving
        what it has. A no-op where nothing sits in front of the hosts."""
        ...

    def stop(self, machine: Machine, timeout_s: float) -> None:
        """Stop its host gracefully (gunicorn's graceful stop: in-flight requests finish,
        the last usage is written, it leaves the fleet), waiting up to timeout_s."""
        ...

    def delete(self, machine: Machine) -> None:
        """Delete it for good (idempotent: deleting a gone machine is not an error)."""
        ...


class ProviderError(Exception):
    """A provider refused a call or did not answer; the message is safe to log."""
