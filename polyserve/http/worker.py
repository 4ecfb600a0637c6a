"""The worker class: uvicorn-worker's, with a strict HTTP protocol and a shutdown that
answers what it already accepted."""

from __future__ import annotations

import asyncio
import socket
import sys
from typing import Any, ClassVar

from gunicorn.arbiter import Arbiter
from uvicorn.server import Server
from uvicorn_worker import UvicornWorker

from polyserve.http import strict

# How long a connection accepted just before shutdown has to deliver its request; over
# loopback it takes microseconds, over a network about half a round trip.
ACCEPT_GRACE_S = 0.1


class _Server(Server):
    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn's shutdown closes every connection that has not started a request yet,
        # including one accepted an instant ago whose request is still on its way: that
        # client gets no answer (the race of gunicorn#2529), at every max_requests
        # recycle and HUP. So stop accepting first, let those requests arrive, and only
        # then let uvicorn close what is really idle.
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        await asyncio.sleep(ACCEPT_GRACE_S)
        await super().shutdown(sockets)


class Worker(UvicornWorker):
    """gunicorn worker class `polyserve.http.worker.Worker` (uvloop + httptools)."""

    # uvicorn would rewrite every scope's client from X-Forwarded-For; the app applies
    # gunicorn's FORWARDED_ALLOW_IPS to space requests only (HostApp.trust_forwarded).
    CONFIG_KWARGS: ClassVar[dict[str, Any]] = {
        **UvicornWorker.CONFIG_KWARGS,
        "proxy_headers": False,
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's httptools protocol, refusing at the door what a strict parser refuses
        # and applying gunicorn's limit_request_* settings (polyserve/http/strict.py).
        self.config.http = strict.protocol(self.cfg)

    async def _serve(self) -> None:
        # uvicorn-worker's own _serve, with the server above.
        self.wsgi.trust_forwarded(self.cfg.forwarded_allow_ips)
        self.config.app = self.wsgi
        server = _Server(config=self.config)
        self._install_sigquit_handler()
        await server.serve(sockets=self.sockets)
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)
