"""contrib/Containerfile: the CPU image builds with podman and serves the seed walkthrough."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.helpers import REPO, alive, descendants, free_port, make_tar, until

INSTALL_HINT = (
    "needs Debian's podman and mmdebstrap, run as root (podman builds with"
    " --isolation=chroot, the host is started by chroot): `apt-get install podman mmdebstrap`"
)
# Made once per machine and kept (podman's store): mmdebstrap takes about a minute, and no
# registry is reachable from these machines to pull a base image from.
BASE = "localhost/polyserve-test-base:trixie"
EXAMPLE = REPO / "examples" / "python-onnx-tiny"

pytestmark = [
    pytest.mark.gunicorn,
    pytest.mark.skipif(
        not (shutil.which("podman") and shutil.which("mmdebstrap") and os.geteuid() == 0),
        reason=INSTALL_HINT,
    ),
]


def podman(*args: str, timeout: float = 600) -> str:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-4000:])
    return done.stdout.strip()


def base_image(tmp: Path) -> str:
    """A Debian base with Python, made locally with mmdebstrap, as the image's BASE."""
    if subprocess.run(["podman", "image", "exists", BASE]).returncode != 0:
        tar = tmp / "base.tar"
        subprocess.run(
            ["mmdebstrap", "--quiet", "--variant=apt",
             "--include=python3,python3-venv,ca-certificates", "trixie", str(tar)],
            check=True, timeout=900,
        )  # fmt: skip
        podman("import", str(tar), BASE)
        tar.unlink()
    return BASE


def pip_passthrough() -> list[str]:
    """This machine's pip settings for the build's `pip install`: a proxy's CA bundle
    (PIP_CERT) is mounted where the build can read it."""
    args = []
    for name, value in os.environ.items():
        if name.startswith("PIP_") and name != "PIP_FIND_LINKS":  # find-links: local paths
            args += ["--env", f"{name}={value}"]
            if name == "PIP_CERT" and Path(value).is_file():
                args += ["--volume", f"{value}:{value}:ro"]
    return args


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tag = f"localhost/polyserve-test:{uuid.uuid4().hex[:12]}"
    base = base_image(tmp_path_factory.mktemp("base"))
    podman(
        "build", "--isolation=chroot", "--quiet", "--build-arg", f"BASE={base}",
        *pip_passthrough(), "-f", "contrib/Containerfile", "-t", tag, str(REPO),
        timeout=1200,
    )  # fmt: skip
    try:
        yield tag
    finally:
        podman("rmi", "--force", tag)


@contextlib.contextmanager
def image_host(tag: str, port: int, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The image's command, with its environment and working directory, run by chroot in
    a container's filesystem: `podman run` needs rlimits these machines do not grant.
    The mounts are made in a mount namespace of the host's own, gone when it exits."""
    config = json.loads(podman("image", "inspect", tag))[0]["Config"]
    env = dict(entry.split("=", 1) for entry in config["Env"])
    env["POLYSERVE_BIND"] = f"127.0.0.1:{port}"  # tests bind loopback
    env["POLYSERVE_WORKERS"] = "2"
    container = podman("create", tag)
    root = podman("mount", container)
    workdir = config["WorkingDir"]
    inner = f"cd {workdir} && exec " + " ".join(shlex.quote(c) for c in config["Cmd"])
    assignments = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
    script = "\n".join(
        [
            f"mount -t proc proc {root}/proc",
            f"mount --rbind /sys {root}/sys",
            f"mount --rbind /dev {root}/dev",
            f"mount -t tmpfs tmpfs {root}/dev/shm",
            f"mount -t tmpfs tmpfs {root}/tmp",
            # exec all the way: the PID this test started is gunicorn's master.
            f"exec chroot {root} env -i {assignments} sh -c {shlex.quote(inner)}",
        ]
    )
    log = open(log_path, "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        podman("umount", container)
        podman("rm", "--force", container)


def test_a_host_started_from_the_cpu_image_answers_deploy_call_and_usage(image, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "host.log"
    with image_host(image, port, log) as proc:

        def ready() -> bool:
            assert proc.poll() is None, f"the image's host exited with {proc.returncode}"
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(url + "/_polyserve/health", timeout=5).status_code == 200
            return False

        until(ready, timeout=60, what="the image's host to answer its health")
        files = {
            p.relative_to(EXAMPLE).as_posix(): p.read_bytes()
            for p in EXAMPLE.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        }
        deployed = httpx.post(
            url + "/_polyserve/deploy",
            data={"space": "lee101/onnx-tiny"},
            files={"module": ("onnx-tiny.tar", make_tar(files))},
            timeout=60,
        )
        assert deployed.status_code == 200, (deployed.text, log.read_text()[-3000:])
        assert deployed.json()["space"] == "lee101/onnx-tiny"
        called = httpx.get(url + "/s/lee101/onnx-tiny/", timeout=60)
        assert called.status_code == 200, called.text
        meta = json.loads((EXAMPLE / "model.json").read_text())
        assert called.json()["held_out_accuracy"] == meta["held_out_accuracy"]
        usage = httpx.get(url + "/_polyserve/usage", timeout=30).json()
        space = usage["spaces"]["lee101/onnx-tiny"]
        assert space["requests"] == 1 and space["loaded"] is True
        # The host runs from the image: the worker that answered has its root there.
        worker = httpx.get(url + "/_polyserve/health", timeout=5).json()["pid"]
        root = os.readlink(f"/proc/{proc.pid}/root")
        assert root != "/" and os.readlink(f"/proc/{worker}/root") == root
        assert os.readlink(f"/proc/{proc.pid}/exe").startswith(root)
        started = descendants(proc.pid)
    assert not [pid for pid in started if alive(pid)], "the image's host left processes behind"
