"""The runpod provider: a pool's hosts as RunPod GPU pods, through RunPod's REST API.

Why the REST API (https://rest.runpod.io/v1) with requests, not the `runpod` SDK: the
provider makes five calls (create, list, get, stop, delete), while runpod 1.12 pulls in
boto3, paramiko, cryptography, aiohttp, fastapi[all], click, tqdm and more — a serverless
worker's toolkit, not a pod client. Its pod calls also go through RunPod's GraphQL API
with the key in the URL's query string, where proxies and debug logs keep URLs; the REST
API takes it as a bearer header. requests is well kept, and the hetzner provider's SDK
already brings it.

Pods are named after the host's fleet id, which starts with polyserve-<pool>-, and a
pool's pods are found by that prefix. RunPod's HTTP proxy is the only way in:
https://<pod id>-<port>.proxy.runpod.net, which the pod learns from RUNPOD_POD_ID at
start (docs/providers.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from polyserve.autoscale import cloud
from polyserve.autoscale.provider import HostSpec, Machine, ProviderError
from polyserve.settings.declare import Setting, const, positive_int

if TYPE_CHECKING:
    import requests

log = logging.getLogger("polyserve.autoscale.runpod")

KEY_VARIABLE = "RUNPOD_API_KEY"
DEFAULT_API_URL = "https://rest.runpod.io/v1"
TIMEOUT_S = (5.0, 30.0)  # connect, read
CLOUD_TYPES = ("SECURE", "COMMUNITY")
RUNNING = "RUNNING"  # desiredStatus of a pod that runs; stop makes it EXITED
TERMINATED = "TERMINATED"


def _cloud_type(text: str) -> str:
    value = text.upper()
    if value not in CLOUD_TYPES:
        raise ValueError(f"must be one of {', '.join(CLOUD_TYPES)}")
    return value


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "runpod_image",
        str,
        const(""),
        "Container image of a GPU host, holding polyserve (docs/providers.md); this or"
        " POLYSERVE_RUNPOD_TEMPLATE_ID is required.",
    ),
    Setting(
        "runpod_template_id",
        str,
        const(""),
        "RunPod template to create pods from (empty: none; the image setting overrides its image).",
    ),
    Setting(
        "runpod_gpu_types",
        str,
        const("NVIDIA GeForce RTX 4090"),
        "Comma-separated RunPod GPU type ids a pod may get, in order of preference.",
    ),
    Setting("runpod_gpu_count", positive_int, const(1), "GPUs per pod."),
    Setting(
        "runpod_cloud_type", _cloud_type, const("SECURE"), "RunPod cloud: SECURE or COMMUNITY."
    ),
    Setting(
        "runpod_container_disk_gb",
        positive_int,
        const(20),
        "Container disk per pod (GB): the data directory lives there, gone with the pod.",
    ),
    Setting(
        "runpod_port",
        cloud.port,
        const(8441),
        "Port a host listens on (0.0.0.0:PORT), exposed through RunPod's HTTP proxy.",
    ),
    Setting(
        "runpod_command",
        str,
        const("gunicorn -c gunicorn.conf.py"),
        "Command a pod runs after computing its advertised URL (`none`: the image's own"
        " CMD, which must compute it: docs/providers.md).",
    ),
    Setting("runpod_api_url", str, const(DEFAULT_API_URL), "RunPod REST API base URL."),
)


@dataclass(frozen=True)
class Options:
    """How a pool's pods are made; built by make() from the settings."""

    image: str = ""
    template_id: str = ""
    gpu_types: tuple[str, ...] = ("NVIDIA GeForce RTX 4090",)
    gpu_count: int = 1
    cloud_type: str = "SECURE"
    container_disk_gb: int = 20
    port: int = 8441
    command: str = "gunicorn -c gunicorn.conf.py"  # "": the image's own CMD


def proxy_url(pod_id: str, port: int) -> str:
    """Where RunPod's HTTP proxy serves a pod's port."""
    return f"https://{pod_id}-{port}.proxy.runpod.net"


def start_command(options: Options) -> list[str]:
    """The pod's start command (dockerStartCmd): its advertised URL from the pod id that
    RunPod sets in RUNPOD_POD_ID, then the host itself, as PID 1 so that it gets the
    stop's SIGTERM. The pod id is unknown until the pod exists, hence at start."""
    url = proxy_url("${RUNPOD_POD_ID}", options.port)
    script = (
        ': "${RUNPOD_POD_ID:?is not set: polyserve expects to run in a RunPod pod}"; '
        f'export POLYSERVE_ADVERTISE_URL="{url}"; '
        f"exec {options.command}"
    )
    return ["sh", "-c", script]


class NotFound(Exception):
    """The pod is gone (404)."""


class RunPodProvider:
    """A pool's hosts as RunPod pods. Every HTTP or API error becomes a ProviderError
    whose message holds neither the API key nor the host's secrets."""

    name = "runpod"

    def __init__(
        self,
        session: requests.Session,
        options: Options,
        *,
        api_url: str,
        api_key: str,
        poll_s: float = 5.0,
    ) -> None:
        self._session = session
        self._session.headers["Authorization"] = f"Bearer {api_key}"
        self.options = options
        self.poll_s = poll_s  # between status reads while a pod stops
        self._url = api_url.rstrip("/")
        self._endpoint = cloud.endpoint_host(api_url)
        self._redact = cloud.Redactor(api_key)
        # When this process first saw each pod: its age, if RunPod does not say.
        self._first_seen: dict[str, float] = {}

    def __repr__(self) -> str:
        return f"RunPodProvider(endpoint={self._endpoint!r}, options={self.options!r})"

    def list(self, pool: str) -> list[Machine]:
        pods = self._call("GET", "/pods", what=f"listing pool {pool}'s pods")
        if not isinstance(pods, list):
            raise ProviderError("runpod: listing pods failed: the answer is not a list")
        prefix = name_prefix(pool)
        return [
            self._machine(pod, pool)
            for pod in pods
            if isinstance(pod, dict)
            and str(pod.get("name", "")).startswith(prefix)
            and pod.get("desiredStatus") != TERMINATED
        ]

    def create(self, spec: HostSpec) -> Machine:
        prefix = name_prefix(spec.pool)
        if not spec.host_id.startswith(prefix):
            # list() would never find it again: refuse before it costs anything.
            raise ProviderError(f"runpod: host id {spec.host_id!r} does not start with {prefix}")
        cloud.check_environment(spec.environment)
        o = self.options
        body: dict[str, Any] = {
            "name": spec.host_id,
            "computeType": "GPU",
            "gpuTypeIds": list(o.gpu_types),
            "gpuCount": o.gpu_count,
            "cloudType": o.cloud_type,
            "containerDiskInGb": o.container_disk_gb,
            "volumeInGb": 0,  # no pod volume: a host's data directory is disposable
            "ports": [f"{o.port}/http"],
            "env": {**spec.environment, "POLYSERVE_BIND": f"0.0.0.0:{o.port}"},
        }
        if o.image:
            body["imageName"] = o.image
        if o.template_id:
            body["templateId"] = o.template_id
        if o.command:
            body["dockerStartCmd"] = start_command(o)
        pod = self._call(
            "POST",
            "/pods",
            body=body,
            what=f"creating pod {spec.host_id}",
            secrets=cloud.secret_values(spec.environment),
        )
        if not isinstance(pod, dict) or not pod.get("id"):
            raise ProviderError(f"runpod: creating pod {spec.host_id}: the answer has no pod id")
        self._first_seen.setdefault(str(pod["id"]), time.time())
        log.info("pool=%s created pod %s (id %s)", spec.pool, spec.host_id, pod["id"])
        return self._machine(pod, spec.pool)

    def take_out(self, machine: Machine) -> None:
        """RunPod's proxy balances nothing: each pod has its own URL, and the fleet's
        drain already keeps new work from the host."""

    def stop(self, machine: Machine, timeout_s: float) -> None:
        what = f"stopping pod {machine.host_id}"

        def stopped() -> bool:
            try:
                pod = self._call("GET", f"/pods/{machine.id}", what=what)
            except NotFound:
                return True
            return isinstance(pod, dict) and pod.get("desiredStatus") != RUNNING

        if stopped():
            return  # nothing to stop, and a second stop call might be refused
        try:
            # The container gets SIGTERM (gunicorn's graceful stop), later SIGKILL.
            self._call("POST", f"/pods/{machine.id}/stop", what=what)
        except NotFound:
            return
        log.info("pool=%s pod %s stopping", machine.pool, machine.host_id)
        if not cloud.wait_until(stopped, timeout_s, self.poll_s):
            log.warning(
                "pool=%s pod %s still running after %.0f s",
                machine.pool,
                machine.host_id,
                timeout_s,
            )

    def delete(self, machine: Machine) -> None:
        try:
            self._call("DELETE", f"/pods/{machine.id}", what=f"deleting pod {machine.host_id}")
        except NotFound:
            log.info("pool=%s pod %s was already gone", machine.pool, machine.host_id)
            return
        self._first_seen.pop(machine.id, None)
        log.info("pool=%s deleted pod %s", machine.pool, machine.host_id)

    def close(self) -> None:
        """Close the HTTP connections."""
        self._session.close()

    # -- helpers --

    def _call(
        self,
        method: str,
        path: str,
        *,
        what: str,
        body: dict[str, Any] | None = None,
        secrets: Iterable[str] = (),
    ) -> Any:
        """One API call: its JSON answer (None if empty). NotFound on 404; every other
        failure is a ProviderError with a message safe to log."""
        import requests

        try:
            answer = self._session.request(
                method, self._url + path, json=body, timeout=TIMEOUT_S, allow_redirects=False
            )
        except requests.RequestException as exc:
            raise ProviderError(
                f"runpod: {what} failed: cannot reach {self._endpoint} ({type(exc).__name__})"
            ) from None
        if answer.status_code == 404:
            raise NotFound(path)
        if not 200 <= answer.status_code < 300:
            message = self._redact(_error_text(answer), secrets)
            raise ProviderError(f"runpod: {what} failed: HTTP {answer.status_code}: {message}")
        if not answer.content:
            return None
        try:
            return answer.json()
        except ValueError:
            raise ProviderError(f"runpod: {what}: the answer is not JSON") from None

    def _machine(self, pod: Mapping[str, Any], pool: str) -> Machine:
        pod_id = str(pod["id"])
        return Machine(
            id=pod_id,
            host_id=str(pod.get("name", "")),
            pool=pool,
            url=proxy_url(pod_id, self.options.port),
            created_at=self._created(pod),
            state=str(pod.get("desiredStatus", "")),
        )

    def _created(self, pod: Mapping[str, Any]) -> float:
        """The pod's creation time; RunPod's schema does not promise one, so its last
        start, or else when this process first saw it."""
        for field in ("createdAt", "lastStartedAt"):
            when = _timestamp(pod.get(field))
            if when is not None:
                return when
        return self._first_seen.setdefault(str(pod["id"]), time.time())


def name_prefix(pool: str) -> str:
    """Every pod of the pool's name starts with this."""
    return f"polyserve-{pool}-"


def _timestamp(value: Any) -> float | None:
    """Unix seconds from an ISO 8601 time, or from Go's default format that RunPod has
    also answered with ("2024-07-12 19:14:40.144 +0000 UTC"); None if neither."""
    if not isinstance(value, str) or not value:
        return None
    text = value.removesuffix(" UTC")
    for parse in (datetime.fromisoformat, _go_time):
        try:
            return parse(text).timestamp()
        except ValueError:
            continue
    return None


def _go_time(text: str) -> datetime:
    date, clock, zone = text.split(" ")  # ValueError unless three parts
    fmt = "%Y-%m-%d %H:%M:%S.%f %z" if "." in clock else "%Y-%m-%d %H:%M:%S %z"
    return datetime.strptime(f"{date} {clock} {zone}", fmt)


def _error_text(answer: requests.Response) -> str:
    """RunPod's error message: {"error": "..."} (or "message"), else the reason."""
    try:
        data = answer.json()
    except ValueError:
        data = None
    if isinstance(data, dict):
        for key in ("error", "message", "detail"):
            if isinstance(data.get(key), str) and data[key]:
                return str(data[key])
    return answer.reason or "no message"


def make(values: Mapping[str, Any]) -> RunPodProvider:
    """The provider from the settings read; the key from RUNPOD_API_KEY only."""
    api_key = cloud.credential(KEY_VARIABLE, "runpod")
    if not values["runpod_image"] and not values["runpod_template_id"]:
        raise ProviderError(
            "POLYSERVE_RUNPOD_IMAGE and POLYSERVE_RUNPOD_TEMPLATE_ID are both empty: set one"
            " to an image (or template) that holds polyserve (docs/providers.md)"
        )
    gpu_types = cloud.names(values["runpod_gpu_types"])
    if not gpu_types:
        raise ProviderError("POLYSERVE_RUNPOD_GPU_TYPES is empty: name at least one GPU type")
    try:
        import requests
    except ImportError:
        raise ProviderError(
            "the runpod provider needs the requests package: pip install 'polyserve[runpod]'"
        ) from None
    from polyserve import __version__

    options = Options(
        image=values["runpod_image"],
        template_id=values["runpod_template_id"],
        gpu_types=gpu_types,
        gpu_count=values["runpod_gpu_count"],
        cloud_type=values["runpod_cloud_type"],
        container_disk_gb=values["runpod_container_disk_gb"],
        port=values["runpod_port"],
        command="" if values["runpod_command"] == "none" else values["runpod_command"],
    )
    session = requests.Session()
    session.headers["User-Agent"] = f"polyserve/{__version__}"
    return RunPodProvider(session, options, api_url=values["runpod_api_url"], api_key=api_key)
