"""The Hetzner Cloud API as the hetzner provider calls it: the hcloud client and its errors.

Every SDK or network error leaves here as a ProviderError whose message holds neither
the token nor the host's secrets. A server, a network or a load balancer that is gone
is an answer (None, False), not an error, where the provider has something to do
about it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from polyserve.autoscale import cloud
from polyserve.autoscale.provider import ProviderError

if TYPE_CHECKING:
    from hcloud import APIException, Client
    from hcloud.networks import BoundNetwork
    from hcloud.servers import BoundServer

# The provider's logger: what the API does is what the provider does.
log = logging.getLogger("polyserve.autoscale.hetzner")


class HetznerAPI:
    """One hcloud client, its calls bounded by `calls()`, and the lookups the provider
    makes: a server by id, the network by name or id, a load balancer's target."""

    def __init__(self, client: Client, *, token: str, endpoint: str) -> None:
        self.client = client
        self.endpoint = cloud.endpoint_host(endpoint)
        self._redact = cloud.Redactor(token)
        self._network: BoundNetwork | None = None

    @contextlib.contextmanager
    def calls(self, what: str, secrets: Iterable[str] = ()) -> Iterator[None]:
        """SDK and network errors as ProviderErrors with a message safe to log. The
        cause is dropped (from None): a traceback would carry the SDK's objects."""
        import requests
        from hcloud import APIException, HCloudException

        try:
            yield
        except APIException as exc:
            message = self._redact(exc.message, secrets)
            raise ProviderError(f"hetzner: {what} failed: {exc.code}: {message}") from None
        except HCloudException as exc:
            raise ProviderError(f"hetzner: {what} failed: {type(exc).__name__}") from None
        except requests.RequestException as exc:
            raise ProviderError(
                f"hetzner: {what} failed: cannot reach {self.endpoint} ({type(exc).__name__})"
            ) from None

    def server(self, server_id: str) -> BoundServer | None:
        """The server as it is now; None once it is gone."""
        from hcloud import APIException

        try:
            return self.client.servers.get_by_id(int(server_id))
        except APIException as exc:
            if _not_found(exc):
                return None
            raise

    def delete_server(self, server_id: str) -> bool:
        """Delete the server; False when it was already gone."""
        from hcloud import APIException
        from hcloud.servers import Server

        try:
            self.client.servers.delete(Server(id=int(server_id)))
        except APIException as exc:
            if not _not_found(exc):
                raise
            return False
        return True

    def network(self, name: str) -> BoundNetwork:
        """The private network named (or numbered) `name`, looked up once."""
        if self._network is None:
            nets = self.client.networks
            found = nets.get_by_id(int(name)) if name.isdigit() else nets.get_by_name(name)
            if found is None:
                raise ProviderError(f"hetzner: network {name!r} not found")
            self._network = found
        return self._network

    def ensure_target(self, name: str, selector: str, use_private_ip: bool) -> None:
        """Give the load balancer `name` a target for the servers `selector` matches,
        unless it has one."""
        from hcloud.load_balancers import LoadBalancerTarget, LoadBalancerTargetLabelSelector

        lb = self.client.load_balancers.get_by_name(name)
        if lb is None:
            raise ProviderError(f"hetzner: load balancer {name!r} not found")
        present = any(
            t.type == "label_selector"
            and t.label_selector
            and t.label_selector.selector == selector
            for t in lb.targets or []
        )
        if not present:
            target = LoadBalancerTarget(
                type="label_selector",
                label_selector=LoadBalancerTargetLabelSelector(selector=selector),
                use_private_ip=use_private_ip,
            )
            self.client.load_balancers.add_target(lb, target)
            log.info("load balancer %s now targets %s", name, selector)

    def close(self) -> None:
        """Close the SDK's HTTP connections."""
        # hcloud keeps a requests.Session per API base and offers no close of its own;
        # reached by name, so a release that renames them only leaves them to the GC.
        for base in ("_client", "_client_hetzner"):
            session = getattr(getattr(self.client, base, None), "_session", None)
            if session is not None:
                session.close()


def _not_found(exc: APIException) -> bool:
    # A JSON error says "not_found"; a bare 404 (a proxy's) only has its status.
    return exc.code in ("not_found", 404)
