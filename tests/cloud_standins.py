"""Stand-ins for the Hetzner Cloud and RunPod APIs: loopback HTTP servers for tests.

They answer the calls our providers make, keep state (servers, pods, labels, statuses,
actions), and check that each call is well formed — the bearer token, the JSON fields and
their types, the label selector — answering a malformed one with the API's own error shape
and a 4xx. They show that our calls are well formed, not that the clouds work: the manual
check in docs/providers.md is the one against real accounts.
"""

from __future__ import annotations

import itertools
import json
import re
import string
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

Answer = tuple[int, Any]  # status, JSON body (None: no body)


class Refused(Exception):
    """A call the real API would refuse: answered with `status` and `message`."""

    def __init__(self, status: int, message: str, code: str = "invalid_input") -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


@dataclass
class Call:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any
    authorization: str


class StandIn:
    """A loopback HTTP server; subclasses route calls to `routes()` and shape errors."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.calls: list[Call] = []
        # Set by a test: every authorized call is answered with this (status, body), or
        # with what this function makes of the call (an API that echoes what it got).
        self.fail: Answer | Callable[[Call], Answer] | None = None
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle --

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> StandIn:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                standin._serve(self)

            do_POST = do_PUT = do_DELETE = do_PATCH = do_GET

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: pytest shows what the tests assert

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join()

    # -- what subclasses give --

    def routes(self) -> list[tuple[str, str, Callable[..., Answer]]]:
        raise NotImplementedError

    def error(self, status: int, message: str, code: str) -> Any:
        raise NotImplementedError

    # -- serving --

    def calls_to(self, method: str, pattern: str) -> list[Call]:
        return [c for c in self.calls if c.method == method and re.fullmatch(pattern, c.path)]

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(handler.path)
        length = int(handler.headers.get("Content-Length") or 0)
        raw = handler.rfile.read(length) if length else b""
        call = Call(
            handler.command,
            parts.path,
            parse_qs(parts.query),
            None,
            handler.headers.get("Authorization", ""),
        )
        try:
            if raw:
                if "application/json" not in handler.headers.get("Content-Type", ""):
                    raise Refused(415, "the body must be JSON", "unsupported_media_type")
                try:
                    call.body = json.loads(raw)
                except ValueError:
                    raise Refused(400, "the body is not valid JSON", "json_error") from None
            with self.lock:
                self.calls.append(call)
                status, body = self._answer(call)
        except Refused as exc:
            status, body = exc.status, self.error(exc.status, exc.message, exc.code)
        data = b"" if body is None else json.dumps(body).encode()
        handler.send_response(status)
        if data:
            handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def _answer(self, call: Call) -> Answer:
        if call.authorization != f"Bearer {self.token}":
            raise Refused(401, "unable to authenticate", "unauthorized")
        if callable(self.fail):
            return self.fail(call)
        if self.fail is not None:
            return self.fail
        for method, pattern, route in self.routes():
            match = re.fullmatch(pattern, call.path)
            if method == call.method and match:
                return route(call, *match.groups())
        raise Refused(404, f"no route {call.method} {call.path}", "not_found")


# -- shared checks --


def need(body: Any, key: str, kind: type | tuple[type, ...], required: bool = True) -> Any:
    """body[key], refused unless it has the type (bool is no int here)."""
    if not isinstance(body, dict):
        raise Refused(400, "the body must be a JSON object")
    if key not in body:
        if required:
            raise Refused(400, f"{key} is required")
        return None
    value = body[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        raise Refused(400, f"{key} has the wrong type: {type(value).__name__}")
    return value


def only(body: dict[str, Any], allowed: set[str]) -> None:
    """Refuse fields the API does not have: a typo would be silently ignored there."""
    if not isinstance(body, dict):
        raise Refused(400, "the body must be a JSON object")
    unknown = set(body) - allowed
    if unknown:
        raise Refused(400, f"unknown fields: {sorted(unknown)}")


def strings(value: Any, key: str) -> None:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise Refused(400, f"{key} must map strings to strings")


def meta(total: int) -> dict[str, Any]:
    """Hetzner's list pagination: everything on one page."""
    page = {"page": 1, "per_page": 50, "previous_page": None, "next_page": None}
    return {"pagination": page | {"last_page": 1, "total_entries": total}}


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


# -- Hetzner Cloud --

_LABEL_KEY = re.compile(r"([a-z0-9.-]{1,253}/)?[a-z0-9A-Z]([a-z0-9A-Z._-]{0,61}[a-z0-9A-Z])?")
_LABEL_VALUE = re.compile(r"([a-z0-9A-Z]([a-z0-9A-Z._-]{0,61}[a-z0-9A-Z])?)?")
_HOSTNAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")


def parse_selector(text: str) -> list[tuple[str, str, str]]:
    """Hetzner's label selector: k=v, k==v, k!=v, k, !k joined by commas."""
    terms = []
    for term in text.split(","):
        if m := re.fullmatch(r"([^=!]+)(==|!=|=)(.*)", term):
            key, op, value = m.groups()
            op = "=" if op == "==" else op
        elif m := re.fullmatch(r"(!?)([^=!]+)", term):
            op, key, value = ("absent" if m.group(1) else "present"), m.group(2), ""
        else:
            raise Refused(400, f"label_selector: bad term {term!r}")
        if not _LABEL_KEY.fullmatch(key) or not _LABEL_VALUE.fullmatch(value):
            raise Refused(400, f"label_selector: bad term {term!r}")
        terms.append((key, op, value))
    return terms


def selected(labels: dict[str, str], terms: list[tuple[str, str, str]]) -> bool:
    for key, op, value in terms:
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and labels.get(key) == value:
            return False
        if op == "present" and key not in labels:
            return False
        if op == "absent" and key in labels:
            return False
    return True


def check_labels(labels: Any) -> dict[str, str]:
    strings(labels, "labels")
    for key, value in labels.items():
        if not _LABEL_KEY.fullmatch(key) or not _LABEL_VALUE.fullmatch(value):
            raise Refused(400, f"invalid label {key}={value}")
    return dict(labels)


@dataclass
class Server:
    id: int
    name: str
    labels: dict[str, str]
    server_type: str
    image: str | int
    location: str
    user_data: str
    ssh_keys: list[Any]
    networks: list[int]
    public_ip: str
    private_ip: str = ""  # shown once attached: after the create answer
    status: str = "running"
    created: str = field(default_factory=now_iso)
    polls_until_off: int | None = 2  # GETs while stopping before off; None: never off

    def json(self, attached: bool = True) -> dict[str, Any]:
        private = [
            {
                "network": n,
                "ip": self.private_ip,
                "alias_ips": [],
                "mac_address": "86:00:00:00:00:01",
            }
            for n in self.networks
            if attached and self.private_ip
        ]
        return {
            "id": self.id,
            "name": self.name,
            "status": self.status,
            "created": self.created,
            "labels": self.labels,
            "public_net": {
                "ipv4": {
                    "id": self.id + 1000,
                    "ip": self.public_ip,
                    "blocked": False,
                    "dns_ptr": "",
                },
                "ipv6": None,
                "floating_ips": [],
                "firewalls": [],
            },
            "private_net": private,
            "server_type": {"id": 1, "name": self.server_type},
            "location": {"id": 1, "name": self.location or "nbg1"},
            "image": None,
            "volumes": [],
        }


class HetznerStandIn(StandIn):
    """Hetzner Cloud API v1: servers, their actions, networks and load balancers."""

    def __init__(self, token: str) -> None:
        super().__init__(token)
        self.servers: dict[int, Server] = {}
        self.networks = [{"id": 7, "name": "polyserve-net", "ip_range": "10.0.0.0/16"}]
        self.load_balancers: list[dict[str, Any]] = [
            {"id": 9, "name": "polyserve-lb", "targets": [], "services": [], "labels": {}}
        ]
        self.actions: list[dict[str, Any]] = []
        self._ids = itertools.count(100)

    def error(self, status: int, message: str, code: str) -> Any:
        return {"error": {"code": code, "message": message, "details": {}}}

    def routes(self) -> list[tuple[str, str, Callable[..., Answer]]]:
        return [
            ("GET", r"/servers", self.list_servers),
            ("POST", r"/servers", self.create_server),
            ("GET", r"/servers/(\d+)", self.get_server),
            ("PUT", r"/servers/(\d+)", self.update_server),
            ("DELETE", r"/servers/(\d+)", self.delete_server),
            ("POST", r"/servers/(\d+)/actions/shutdown", self.shutdown),
            ("GET", r"/networks", self.list_networks),
            ("GET", r"/networks/(\d+)", self.get_network),
            ("GET", r"/load_balancers", self.list_load_balancers),
            ("POST", r"/load_balancers/(\d+)/actions/add_target", self.add_target),
        ]

    # -- what tests set up and look at --

    def add_server(self, name: str, labels: dict[str, str], **kw: Any) -> Server:
        """A server made outside the provider (by hand, or by another pool's)."""
        sid = next(self._ids)
        kw.setdefault("public_ip", f"95.217.0.{sid % 250}")
        server = Server(sid, name, labels, "cx22", "ubuntu-24.04", "nbg1", "", [], [], **kw)
        self.servers[sid] = server
        return server

    def by_name(self, name: str) -> Server:
        return next(s for s in self.servers.values() if s.name == name)

    def lb_members(self, name: str) -> set[str]:
        """The servers a load balancer sends to: those its label selectors match."""
        lb = next(b for b in self.load_balancers if b["name"] == name)
        selectors = [
            parse_selector(t["label_selector"]["selector"])
            for t in lb["targets"]
            if t["type"] == "label_selector"
        ]
        return {
            s.name for s in self.servers.values() if any(selected(s.labels, t) for t in selectors)
        }

    # -- routes --

    def _find(self, sid: str) -> Server:
        server = self.servers.get(int(sid))
        if server is None:
            raise Refused(404, f"server with ID '{sid}' not found", "not_found")
        return server

    def _action(self, command: str, sid: int) -> dict[str, Any]:
        action = {
            "id": next(self._ids),
            "command": command,
            "status": "running",
            "progress": 0,
            "started": now_iso(),
            "finished": None,
            "resources": [{"id": sid, "type": "server"}],
            "error": None,
        }
        self.actions.append(action)
        return action

    def _page(self, call: Call) -> None:
        for key in ("page", "per_page"):
            for value in call.query.get(key, []):
                if not value.isdigit():
                    raise Refused(400, f"{key} must be a number")

    def list_servers(self, call: Call) -> Answer:
        self._page(call)
        servers = list(self.servers.values())
        for text in call.query.get("label_selector", []):
            terms = parse_selector(text)
            servers = [s for s in servers if selected(s.labels, terms)]
        for name in call.query.get("name", []):
            servers = [s for s in servers if s.name == name]
        return 200, {"servers": [s.json() for s in servers], "meta": meta(len(servers))}

    def create_server(self, call: Call) -> Answer:
        body = call.body
        only(body, {"name", "server_type", "image", "start_after_create", "location"}
             | {"ssh_keys", "networks", "user_data", "labels", "volumes", "firewalls"}
             | {"automount", "placement_group", "public_net", "datacenter"})  # fmt: skip
        name = need(body, "name", str)
        if not _HOSTNAME.fullmatch(name):
            raise Refused(400, "name must be a valid hostname")
        if any(s.name == name for s in self.servers.values()):
            raise Refused(409, "server name is already used", "uniqueness_error")
        server_type = need(body, "server_type", (str, int))
        image = need(body, "image", (str, int))
        need(body, "start_after_create", bool, required=False)
        location = need(body, "location", (str, int), required=False) or ""
        user_data = need(body, "user_data", str, required=False) or ""
        if len(user_data.encode()) > 32 * 1024:
            raise Refused(400, "user_data is over 32 KiB")
        labels = check_labels(need(body, "labels", dict, required=False) or {})
        ssh_keys = need(body, "ssh_keys", list, required=False) or []
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in ssh_keys):
            raise Refused(400, "ssh_keys must be names or ids")
        networks = need(body, "networks", list, required=False) or []
        known = {n["id"] for n in self.networks}
        if not all(isinstance(n, int) and n in known for n in networks):
            raise Refused(400, f"networks must be ids of existing networks, got {networks}")
        sid = next(self._ids)
        server = Server(
            sid,
            name,
            labels,
            str(server_type),
            image,
            str(location),
            user_data,
            ssh_keys,
            networks,
            public_ip=f"95.217.0.{sid % 250}",
            private_ip=f"10.0.0.{sid % 250}" if networks else "",
            status="initializing",
        )
        self.servers[sid] = server
        answer = {
            "server": server.json(attached=False),  # the network attaches a moment later
            "action": self._action("create_server", sid),
            "next_actions": [self._action("start_server", sid)],
            "root_password": None,
        }
        server.status = "running"
        return 201, answer

    def get_server(self, call: Call, sid: str) -> Answer:
        server = self._find(sid)
        if server.status == "stopping" and server.polls_until_off is not None:
            if server.polls_until_off <= 0:
                server.status = "off"
            server.polls_until_off -= 1
        return 200, {"server": server.json()}

    def update_server(self, call: Call, sid: str) -> Answer:
        server = self._find(sid)
        only(call.body, {"name", "labels"})
        if "labels" in call.body:
            server.labels = check_labels(call.body["labels"])
        return 200, {"server": server.json()}

    def delete_server(self, call: Call, sid: str) -> Answer:
        server = self._find(sid)
        del self.servers[server.id]
        return 200, {"action": self._action("delete_server", server.id)}

    def shutdown(self, call: Call, sid: str) -> Answer:
        server = self._find(sid)
        if call.body not in (None, {}):
            raise Refused(400, "shutdown takes no body")
        if server.status == "running":
            server.status = "stopping"
        return 201, {"action": self._action("shutdown_server", server.id)}

    def list_networks(self, call: Call) -> Answer:
        self._page(call)
        found = [n for n in self.networks if n["name"] in call.query.get("name", [n["name"]])]
        return 200, {"networks": [self._network(n) for n in found], "meta": meta(len(found))}

    def get_network(self, call: Call, nid: str) -> Answer:
        for n in self.networks:
            if n["id"] == int(nid):
                return 200, {"network": self._network(n)}
        raise Refused(404, f"network with ID '{nid}' not found", "not_found")

    def _network(self, n: dict[str, Any]) -> dict[str, Any]:
        return n | {"subnets": [], "routes": [], "servers": [], "labels": {}}

    def list_load_balancers(self, call: Call) -> Answer:
        self._page(call)
        names = call.query.get("name")
        found = [b for b in self.load_balancers if names is None or b["name"] in names]
        return 200, {"load_balancers": found, "meta": meta(len(found))}

    def add_target(self, call: Call, lid: str) -> Answer:
        lb = next((b for b in self.load_balancers if b["id"] == int(lid)), None)
        if lb is None:
            raise Refused(404, f"load balancer with ID '{lid}' not found", "not_found")
        body = call.body
        only(body, {"type", "label_selector", "use_private_ip", "server", "ip"})
        if need(body, "type", str) != "label_selector":
            raise Refused(400, "this stand-in only takes label_selector targets")
        selector = need(need(body, "label_selector", dict), "selector", str)
        parse_selector(selector)
        use_private_ip = need(body, "use_private_ip", bool, required=False) or False
        if any(t["label_selector"]["selector"] == selector for t in lb["targets"]):
            raise Refused(409, "target already exists", "target_already_defined")
        lb["targets"].append(
            {
                "type": "label_selector",
                "label_selector": {"selector": selector},
                "use_private_ip": use_private_ip,
                "targets": [],
            }
        )
        return 201, {"action": self._action("add_target", lb["id"])}


# -- RunPod --

_CREATE_FIELDS = {
    "allowedCudaVersions",
    "cloudType",
    "computeType",
    "containerDiskInGb",
    "containerRegistryAuthId",
    "countryCodes",
    "cpuFlavorIds",
    "cpuFlavorPriority",
    "dataCenterIds",
    "dataCenterPriority",
    "dockerEntrypoint",
    "dockerStartCmd",
    "env",
    "globalNetworking",
    "gpuCount",
    "gpuTypeIds",
    "gpuTypePriority",
    "imageName",
    "interruptible",
    "locked",
    "minDiskBandwidthMBps",
    "minDownloadMbps",
    "minRAMPerGPU",
    "minUploadMbps",
    "minVCPUPerGPU",
    "name",
    "networkVolumeId",
    "ports",
    "supportPublicIp",
    "templateId",
    "vcpuCount",
    "volumeInGb",
    "volumeMountPath",
}  # fmt: skip  (PodCreateInput in RunPod's openapi.json, REST v1)


class RunPodStandIn(StandIn):
    """RunPod REST API v1: /pods, /pods/{id}, /pods/{id}/stop, DELETE /pods/{id}."""

    def __init__(self, token: str) -> None:
        super().__init__(token)
        self.pods: dict[str, dict[str, Any]] = {}
        self.polls_until_exited: int | None = 2  # GETs after a stop; None: never exits
        self._countdown: dict[str, int | None] = {}
        self._ids = (f"{n:014x}"[-14:] for n in itertools.count(0x5A1700000000))

    def error(self, status: int, message: str, code: str) -> Any:
        return {"error": message, "status": status}

    def routes(self) -> list[tuple[str, str, Callable[..., Answer]]]:
        return [
            ("GET", r"/pods", self.list_pods),
            ("POST", r"/pods", self.create_pod),
            ("GET", r"/pods/([a-z0-9]+)", self.get_pod),
            ("POST", r"/pods/([a-z0-9]+)/stop", self.stop_pod),
            ("DELETE", r"/pods/([a-z0-9]+)", self.delete_pod),
        ]

    def add_pod(self, name: str, status: str = "RUNNING") -> dict[str, Any]:
        """A pod made outside the provider."""
        pod = {"id": next(self._ids), "name": name, "desiredStatus": status, "env": {}}
        self.pods[pod["id"]] = pod
        return pod

    def by_name(self, name: str) -> dict[str, Any]:
        return next(p for p in self.pods.values() if p["name"] == name)

    def _pod(self, pid: str) -> dict[str, Any]:
        if pid not in self.pods:
            raise Refused(404, "pod not found", "not_found")
        return self.pods[pid]

    def list_pods(self, call: Call) -> Answer:
        return 200, list(self.pods.values())

    def get_pod(self, call: Call, pid: str) -> Answer:
        pod = self._pod(pid)
        left = self._countdown.get(pid)
        if pod["desiredStatus"] == "RUNNING" and left is not None:
            if left <= 0:
                pod["desiredStatus"] = "EXITED"
            self._countdown[pid] = left - 1
        return 200, pod

    def create_pod(self, call: Call) -> Answer:
        body = call.body
        if not isinstance(body, dict):
            raise Refused(400, "the body must be a JSON object")
        only(body, _CREATE_FIELDS)
        name = need(body, "name", str)
        if not 0 < len(name) <= 191:
            raise Refused(400, "name must have 1 to 191 characters")
        image = need(body, "imageName", str, required=False)
        template = need(body, "templateId", str, required=False)
        if not image and not template:
            raise Refused(400, "imageName or templateId is required")
        if need(body, "computeType", str, required=False) not in (None, "GPU"):
            raise Refused(400, "computeType must be GPU here")
        gpus = need(body, "gpuTypeIds", list)
        if not gpus or not all(isinstance(g, str) and g for g in gpus):
            raise Refused(400, "gpuTypeIds must be a list of GPU type ids")
        if need(body, "gpuCount", int, required=False) is not None and body["gpuCount"] < 1:
            raise Refused(400, "gpuCount must be at least 1")
        if need(body, "cloudType", str, required=False) not in (None, "SECURE", "COMMUNITY"):
            raise Refused(400, "cloudType must be SECURE or COMMUNITY")
        for key in ("containerDiskInGb", "volumeInGb"):
            if (need(body, key, int, required=False) or 0) < 0:
                raise Refused(400, f"{key} must not be negative")
        ports = need(body, "ports", list, required=False) or []
        if not all(isinstance(p, str) and re.fullmatch(r"\d{1,5}/(http|tcp)", p) for p in ports):
            raise Refused(400, "ports must be like 8888/http or 22/tcp")
        env = need(body, "env", dict, required=False) or {}
        strings(env, "env")
        start = need(body, "dockerStartCmd", list, required=False)
        if start is not None and not all(isinstance(a, str) for a in start):
            raise Refused(400, "dockerStartCmd must be a list of strings")
        pod = {
            "id": next(self._ids),
            "name": name,
            "desiredStatus": "RUNNING",
            "image": image or "from-template",
            "templateId": template,
            "env": env,
            "ports": ports,
            "dockerStartCmd": start or [],
            "gpu": {"id": gpus[0], "count": body.get("gpuCount", 1)},
            "containerDiskInGb": body.get("containerDiskInGb"),
            "volumeInGb": body.get("volumeInGb"),
            "lastStartedAt": now_iso(),
            "costPerHr": 0.69,
        }
        self.pods[pod["id"]] = pod
        return 201, pod

    def stop_pod(self, call: Call, pid: str) -> Answer:
        pod = self._pod(pid)
        if call.body is not None:
            raise Refused(400, "stop takes no body")
        self._countdown[pid] = self.polls_until_exited
        return 200, pod

    def delete_pod(self, call: Call, pid: str) -> Answer:
        self._pod(pid)
        del self.pods[pid]
        return 204, None


def closed_port_url() -> str:
    """A loopback URL where nothing listens: an unreachable API."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def random_token(n: int = 40) -> str:
    import secrets

    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(n))


def running(standin: StandIn) -> Iterator[StandIn]:
    """For a fixture: the stand-in started, then stopped."""
    standin.start()
    try:
        yield standin
    finally:
        standin.stop()
