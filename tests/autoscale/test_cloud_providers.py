"""Contract tests of the hetzner and runpod providers against loopback stand-ins of their
APIs (tests/cloud_standins.py): our calls are well formed and the providers keep their
promises. They do not show that the clouds work: docs/providers.md has the manual check."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from polyserve.autoscale import cloud, hetzner, hetznerboot, runpod
from polyserve.autoscale.provider import HostSpec, Machine, ProviderError
from polyserve.settings.declare import read
from polyserve.settings.docs import markdown_table
from tests.cloud_standins import (
    Call,
    HetznerStandIn,
    RunPodStandIn,
    closed_port_url,
    random_token,
    running,
)
from tests.helpers import REPO

HCLOUD_TOKEN = "hc-" + random_token()
RUNPOD_KEY = "rpa_" + random_token()
DB_PASSWORD = "pw-" + random_token(12)
DB_URL = f"postgresql://polyserve:{DB_PASSWORD}@db.internal:5432/polyserve?sslmode=require"
# Characters a shell or systemd would take for something else, to check the env file.
ODD_DB_URL = "postgresql://polyserve:p$HOME`id`\"q'\\r%41@db.internal/polyserve"


def spec(pool: str = "cpu", host_id: str = "", db_url: str = DB_URL) -> HostSpec:
    host_id = host_id or f"polyserve-{pool}-0a1b2c3d"
    env = {
        "POLYSERVE_DATABASE_URL": db_url,
        "POLYSERVE_POOL": pool,
        "POLYSERVE_HOST_ID": host_id,
        "POLYSERVE_DEPLOY_TOKEN_SHA256": "ab" * 32,
    }
    return HostSpec(pool, host_id, env)


def assert_no_secrets(*texts: str) -> None:
    for text in texts:
        for secret in (HCLOUD_TOKEN, RUNPOD_KEY, DB_URL, DB_PASSWORD):
            assert secret not in text


# -- Hetzner --


@pytest.fixture
def hetzner_api() -> Iterator[HetznerStandIn]:
    yield from running(HetznerStandIn(HCLOUD_TOKEN))


@pytest.fixture
def make_hetzner(
    monkeypatch: pytest.MonkeyPatch, hetzner_api: HetznerStandIn
) -> Iterator[Callable[..., hetzner.HetznerProvider]]:
    """hetzner.make() from POLYSERVE_HETZNER_* settings, pointed at the stand-in."""
    made: list[hetzner.HetznerProvider] = []

    def make(token: str = HCLOUD_TOKEN, **settings: str) -> hetzner.HetznerProvider:
        monkeypatch.setenv("HCLOUD_TOKEN", token)
        env = {"POLYSERVE_HETZNER_ENDPOINT": hetzner_api.url, "POLYSERVE_HETZNER_IMAGE": "424242"}
        env |= {f"POLYSERVE_HETZNER_{k.upper()}": v for k, v in settings.items()}
        provider = hetzner.make(read(hetzner.SETTINGS, env) | {"stop_timeout_s": 75.0})
        provider.poll_s = 0.01
        made.append(provider)
        return provider

    yield make
    for provider in made:
        provider.close()


def test_hetzner_create_makes_a_labelled_server_named_after_the_host(make_hetzner, hetzner_api):
    """The server is named after the fleet id, labelled as ours and the pool's, built from
    the configured type, snapshot, location and SSH keys; the machine says where it is."""
    provider = make_hetzner(ssh_keys="ops, ci")
    machine = provider.create(spec())
    server = hetzner_api.by_name("polyserve-cpu-0a1b2c3d")
    assert server.labels == {
        "polyserve": "host",
        "polyserve-pool": "cpu",
        "polyserve-traffic": "in",
    }
    body = hetzner_api.calls_to("POST", "/servers")[0].body
    assert body["image"] == 424242  # a snapshot id travels as a number
    assert (body["server_type"], body["location"], body["ssh_keys"]) == (
        "cx22",
        "nbg1",
        ["ops", "ci"],
    )
    assert "networks" not in body
    assert machine == Machine(
        id=str(server.id),
        host_id="polyserve-cpu-0a1b2c3d",
        pool="cpu",
        url=f"http://{server.public_ip}:8441",
        created_at=datetime.fromisoformat(server.created).timestamp(),
        state="initializing",
    )


def test_hetzner_image_by_name(make_hetzner, hetzner_api):
    make_hetzner(image="ubuntu-24.04").create(spec())
    assert hetzner_api.calls_to("POST", "/servers")[0].body["image"] == "ubuntu-24.04"


def test_hetzner_list_finds_the_pools_servers_by_label(make_hetzner, hetzner_api):
    """A server without our labels, or another pool's, is not listed."""
    provider = make_hetzner()
    mine = provider.create(spec())
    hetzner_api.add_server("db-1", {})
    hetzner_api.add_server("polyserve-gpu-1", {"polyserve": "host", "polyserve-pool": "gpu"})
    hetzner_api.add_server("bastion", {"polyserve-pool": "cpu"})  # not labelled polyserve=host
    listed = provider.list("cpu")
    assert [m.host_id for m in listed] == [mine.host_id]
    assert listed[0].state == "running"
    selectors = [c.query["label_selector"] for c in hetzner_api.calls_to("GET", "/servers")]
    assert selectors == [["polyserve=host,polyserve-pool=cpu"]]
    assert [m.host_id for m in provider.list("gpu")] == ["polyserve-gpu-1"]


def user_data(api: HetznerStandIn, host_id: str = "polyserve-cpu-0a1b2c3d") -> dict[str, Any]:
    text = api.by_name(host_id).user_data
    assert text.startswith("#cloud-config\n")
    return yaml.safe_load(text)


def written(config: dict[str, Any], path: str) -> dict[str, Any]:
    return next(f for f in config["write_files"] if f["path"] == path)


def test_hetzner_user_data_writes_a_root_only_env_file_and_starts_polyserve(
    make_hetzner, hetzner_api, tmp_path
):
    """cloud-init writes the environment (mode 0600, root's) in a form a shell and
    systemd read back exactly, then starts the unit that reads it."""
    make_hetzner().create(spec(db_url=ODD_DB_URL))
    config = user_data(hetzner_api)
    env = written(config, hetznerboot.ENV_FILE)
    assert (env["permissions"], env["owner"]) == ("0600", "root:root")
    path = tmp_path / "host.env"
    path.write_text(env["content"])
    script = 'set -a; . "$1"; printf "%s\\n%s" "$POLYSERVE_DATABASE_URL" "$POLYSERVE_BIND"'
    shown = subprocess.run(["sh", "-c", script, "sh", path], capture_output=True, text=True)
    assert shown.stdout == f"{ODD_DB_URL}\n0.0.0.0:8441"
    assert 'POLYSERVE_HOST_ID="polyserve-cpu-0a1b2c3d"\n' in env["content"]
    # The advertised URL is found first; then the unit starts, and restarts on reboot.
    assert config["runcmd"] == [
        [hetznerboot.ADVERTISE_SCRIPT, "", "8441", hetznerboot.ADVERTISE_FILE],
        ["systemctl", "daemon-reload"],
        ["systemctl", "enable", "--now", "polyserve.service"],
    ]
    assert written(config, hetznerboot.ADVERTISE_SCRIPT)["permissions"] == "0755"


def test_hetzner_unit_stops_gunicorn_gracefully(make_hetzner, hetzner_api):
    """systemd sends SIGTERM to the gunicorn master only and waits the autoscaler's stop
    timeout; the environment comes from the root-only file."""
    command = "/srv/ps/.venv/bin/gunicorn -c g.py"
    make_hetzner(user="svc", workdir="/srv/ps", command=command).create(spec())
    unit = written(user_data(hetzner_api), "/etc/systemd/system/polyserve.service")["content"]
    lines = [line for line in unit.splitlines() if line and not line.startswith("#")]
    assert "KillSignal=SIGTERM" in lines
    assert "KillMode=mixed" in lines
    assert "TimeoutStopSec=75" in lines
    assert "User=svc" in lines
    assert "WorkingDirectory=/srv/ps" in lines
    assert "ExecStart=/srv/ps/.venv/bin/gunicorn -c g.py" in lines
    assert f"EnvironmentFile={hetznerboot.ENV_FILE}" in lines
    assert f"EnvironmentFile={hetznerboot.ADVERTISE_FILE}" in lines
    assert "WantedBy=multi-user.target" in lines


@pytest.fixture
def fake_ip(tmp_path: Path) -> dict[str, str]:
    """An `ip` command on PATH that answers like a Hetzner server's: loopback, a public
    IPv4 on eth0, and an address in a private network."""
    links = [
        {"ifname": "lo", "addr_info": [{"family": "inet", "local": "127.0.0.1"}]},
        {"ifname": "eth0", "addr_info": [{"family": "inet", "local": "95.217.1.2"}]},
        {"ifname": "enp7s0", "addr_info": [{"family": "inet", "local": "10.0.0.5"}]},
    ]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ip = bin_dir / "ip"
    ip.write_text(f"#!/bin/sh\ncat <<'EOF'\n{json.dumps(links)}\nEOF\n")
    ip.chmod(ip.stat().st_mode | stat.S_IXUSR)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.parametrize(
    ("network", "expected"),
    [("10.0.0.0/16", "http://10.0.0.5:8441"), ("", "http://95.217.1.2:8441")],
)
def test_hetzner_advertise_script_finds_the_address_other_machines_reach(
    tmp_path, fake_ip, network, expected
):
    """In a private network the host advertises its address there, else its public
    IPv4 — never loopback."""
    script = tmp_path / "polyserve-advertise"
    script.write_text(hetznerboot.ADVERTISE_PY)
    out = tmp_path / "advertise.env"
    subprocess.run([sys.executable, script, network, "8441", out], env=fake_ip, check=True)
    assert out.read_text() == f"POLYSERVE_ADVERTISE_URL={expected}\n"


def test_hetzner_network_hosts_advertise_their_private_address(make_hetzner, hetzner_api):
    """With a network, the server joins it; its URL is the private address, unknown
    until Hetzner has attached it, and the boot script looks in the network's range."""
    provider = make_hetzner(network="polyserve-net")
    machine = provider.create(spec())
    assert hetzner_api.calls_to("POST", "/servers")[0].body["networks"] == [7]
    assert machine.url == ""
    server = hetzner_api.by_name(machine.host_id)
    assert [m.url for m in provider.list("cpu")] == [f"http://{server.private_ip}:8441"]
    assert user_data(hetzner_api)["runcmd"][0][1] == "10.0.0.0/16"


def test_hetzner_unknown_network_is_a_clear_error(make_hetzner, hetzner_api):
    with pytest.raises(ProviderError, match="network 'nope' not found"):
        make_hetzner(network="nope").create(spec())
    assert hetzner_api.servers == {}


def test_hetzner_take_out_without_a_load_balancer_calls_nothing(make_hetzner, hetzner_api):
    provider = make_hetzner()
    machine = provider.create(spec())
    before = len(hetzner_api.calls)
    provider.take_out(machine)
    assert len(hetzner_api.calls) == before
    assert hetzner_api.by_name(machine.host_id).labels["polyserve-traffic"] == "in"


def test_hetzner_load_balancer_follows_the_pool_and_take_out_removes_a_host(
    make_hetzner, hetzner_api
):
    """The load balancer gets one label-selector target per pool; take_out relabels the
    server so the selector no longer matches it, and it is still the pool's."""
    provider = make_hetzner(load_balancer="polyserve-lb")
    first = provider.create(spec())
    second = provider.create(spec(host_id="polyserve-cpu-99999999"))
    lb = hetzner_api.load_balancers[0]
    assert [t["label_selector"]["selector"] for t in lb["targets"]] == [
        "polyserve=host,polyserve-pool=cpu,polyserve-traffic=in"
    ]
    assert lb["targets"][0]["use_private_ip"] is False
    assert hetzner_api.lb_members("polyserve-lb") == {first.host_id, second.host_id}

    provider.take_out(first)
    assert hetzner_api.lb_members("polyserve-lb") == {second.host_id}
    assert hetzner_api.by_name(first.host_id).labels["polyserve-pool"] == "cpu"
    assert {m.host_id for m in provider.list("cpu")} == {first.host_id, second.host_id}


def test_hetzner_load_balancer_target_already_there_is_kept(make_hetzner, hetzner_api):
    """An autoscaler restarted finds its target in place and adds no second one."""
    make_hetzner(load_balancer="polyserve-lb").create(spec())
    make_hetzner(load_balancer="polyserve-lb").create(spec(host_id="polyserve-cpu-2"))
    assert len(hetzner_api.load_balancers[0]["targets"]) == 1
    assert len(hetzner_api.calls_to("POST", r"/load_balancers/\d+/actions/add_target")) == 1


def test_hetzner_missing_load_balancer_is_a_clear_error(make_hetzner, hetzner_api):
    with pytest.raises(ProviderError, match="load balancer 'gone-lb' not found"):
        make_hetzner(load_balancer="gone-lb").create(spec())
    assert hetzner_api.servers == {}


def test_hetzner_stop_shuts_down_and_waits_until_off(make_hetzner, hetzner_api):
    """stop() asks for an ACPI shutdown (the graceful one) and returns once it is off."""
    provider = make_hetzner()
    machine = provider.create(spec())
    hetzner_api.by_name(machine.host_id).polls_until_off = 3
    provider.stop(machine, timeout_s=30)
    assert [a["command"] for a in hetzner_api.actions][-1] == "shutdown_server"
    assert hetzner_api.by_name(machine.host_id).status == "off"
    assert [m.state for m in provider.list("cpu")] == ["off"]


def test_hetzner_stop_gives_up_after_its_timeout(make_hetzner, hetzner_api, caplog):
    provider = make_hetzner()
    machine = provider.create(spec())
    hetzner_api.by_name(machine.host_id).polls_until_off = None  # it never turns off
    provider.stop(machine, timeout_s=0.05)
    assert hetzner_api.by_name(machine.host_id).status == "stopping"
    assert "is not off after" in caplog.text


def test_hetzner_stop_of_an_off_or_gone_server_asks_nothing(make_hetzner, hetzner_api):
    provider = make_hetzner()
    machine = provider.create(spec())
    hetzner_api.by_name(machine.host_id).status = "off"
    provider.stop(machine, timeout_s=30)
    provider.delete(machine)
    provider.stop(machine, timeout_s=30)
    assert hetzner_api.calls_to("POST", r"/servers/\d+/actions/shutdown") == []


def test_hetzner_delete_removes_the_server_and_twice_is_fine(make_hetzner, hetzner_api):
    provider = make_hetzner()
    machine = provider.create(spec())
    provider.delete(machine)
    assert provider.list("cpu") == []
    provider.delete(machine)  # 404: already gone
    assert len(hetzner_api.calls_to("DELETE", r"/servers/\d+")) == 2


def test_hetzner_refuses_a_host_id_that_is_no_server_name(make_hetzner, hetzner_api):
    with pytest.raises(ProviderError, match="not a valid server name"):
        make_hetzner().create(spec(host_id="host:8441"))
    assert hetzner_api.calls == []


def echo(api_error: Callable[[str], Any], seen: list[str]) -> Callable[[Call], Any]:
    """A failure that quotes what it got, as careless APIs do: the bearer token and any
    database URL in the request."""

    def answer(call: Call) -> tuple[int, Any]:
        body = json.dumps(call.body) if call.body is not None else ""
        quoted = call.authorization + (f" {DB_URL}" if DB_URL in body else "")
        seen.append(quoted)
        return 500, api_error(f"internal error handling {quoted}")

    return answer


def act(provider: Any, call: str, pool: str, machine_id: str) -> None:
    """One provider call by name: the create sends the database URL, the others not."""
    if call == "create":
        provider.create(spec(pool))
    elif call == "list":
        provider.list(pool)
    else:
        provider.delete(Machine(machine_id, f"polyserve-{pool}-1", pool, "", 0.0))


@pytest.mark.parametrize("failure", ["unauthorized", "server error", "unreachable"])
@pytest.mark.parametrize("call", ["create", "list", "delete"])
def test_hetzner_errors_are_provider_errors_without_secrets(
    make_hetzner, hetzner_api, caplog, failure, call
):
    caplog.set_level(logging.DEBUG)  # urllib3's and the SDK's own logs too
    seen: list[str] = []
    if failure == "unauthorized":
        provider = make_hetzner(token="hc-not-the-right-token-" + random_token(8))
    elif failure == "server error":
        provider = make_hetzner()
        hetzner_api.fail = echo(lambda m: {"error": {"code": "server_error", "message": m}}, seen)
    else:
        provider = make_hetzner(endpoint=closed_port_url())
    with pytest.raises(ProviderError) as raised:
        act(provider, call, "cpu", machine_id="123")
    message = str(raised.value)
    assert message.startswith("hetzner: ")
    assert {"unauthorized": "unauthorized", "server error": "server_error"}.get(
        failure, "cannot reach 127.0.0.1"
    ) in message
    if failure == "server error":  # the stand-in did quote the secrets to us
        assert HCLOUD_TOKEN in seen[0]
        assert (DB_URL in seen[0]) == (call == "create")
        assert "<redacted>" in message
    assert_no_secrets(message, "".join(traceback.format_exception(raised.value)), caplog.text)
    assert_no_secrets(repr(provider))


def test_hetzner_make_without_the_token_names_the_variable(monkeypatch):
    monkeypatch.delenv("HCLOUD_TOKEN", raising=False)
    values = read(hetzner.SETTINGS, {"POLYSERVE_HETZNER_IMAGE": "1"})
    with pytest.raises(ProviderError, match="HCLOUD_TOKEN is not set"):
        hetzner.make(values)


def test_hetzner_make_without_an_image_says_so(monkeypatch):
    monkeypatch.setenv("HCLOUD_TOKEN", HCLOUD_TOKEN)
    with pytest.raises(ProviderError, match="POLYSERVE_HETZNER_IMAGE is empty"):
        hetzner.make(read(hetzner.SETTINGS, {}))


# -- RunPod --


@pytest.fixture
def runpod_api() -> Iterator[RunPodStandIn]:
    yield from running(RunPodStandIn(RUNPOD_KEY))


@pytest.fixture
def make_runpod(
    monkeypatch: pytest.MonkeyPatch, runpod_api: RunPodStandIn
) -> Iterator[Callable[..., runpod.RunPodProvider]]:
    """runpod.make() from POLYSERVE_RUNPOD_* settings, pointed at the stand-in."""
    made: list[runpod.RunPodProvider] = []

    def make(key: str = RUNPOD_KEY, **settings: str) -> runpod.RunPodProvider:
        monkeypatch.setenv("RUNPOD_API_KEY", key)
        env = {
            "POLYSERVE_RUNPOD_API_URL": runpod_api.url,
            "POLYSERVE_RUNPOD_IMAGE": "ghcr.io/x/ps:1",
        }
        env |= {f"POLYSERVE_RUNPOD_{k.upper()}": v for k, v in settings.items()}
        provider = runpod.make(read(runpod.SETTINGS, env))
        provider.poll_s = 0.01
        made.append(provider)
        return provider

    yield make
    for provider in made:
        provider.close()


def test_runpod_create_sends_a_well_formed_pod(make_runpod, runpod_api):
    """The pod is named after the host, asks for the configured GPUs, exposes the port
    over HTTP, and gets the host's environment plus where to listen."""
    provider = make_runpod(gpu_types="NVIDIA L4, NVIDIA A40", gpu_count="2")
    machine = provider.create(spec("gpu"))
    body = runpod_api.calls_to("POST", "/pods")[0].body
    assert body["name"] == "polyserve-gpu-0a1b2c3d"
    assert body["imageName"] == "ghcr.io/x/ps:1"
    assert "templateId" not in body
    assert (body["gpuTypeIds"], body["gpuCount"], body["computeType"]) == (
        ["NVIDIA L4", "NVIDIA A40"],
        2,
        "GPU",
    )
    assert (body["cloudType"], body["containerDiskInGb"], body["volumeInGb"]) == ("SECURE", 20, 0)
    assert body["ports"] == ["8441/http"]
    assert body["env"] == {**spec("gpu").environment, "POLYSERVE_BIND": "0.0.0.0:8441"}
    pod = runpod_api.by_name("polyserve-gpu-0a1b2c3d")
    assert machine.id == pod["id"]
    assert machine.url == f"https://{pod['id']}-8441.proxy.runpod.net"
    assert (machine.host_id, machine.pool, machine.state) == (pod["name"], "gpu", "RUNNING")


def test_runpod_start_command_advertises_the_pods_proxy_url(make_runpod, runpod_api):
    """The pod learns its id only once it runs: the start command builds the URL from
    RUNPOD_POD_ID, then execs the host with it."""
    make_runpod(command="printenv POLYSERVE_ADVERTISE_URL").create(spec("gpu"))
    argv = runpod_api.by_name("polyserve-gpu-0a1b2c3d")["dockerStartCmd"]
    env = {"PATH": os.environ["PATH"], "RUNPOD_POD_ID": "abc123xyz"}
    ran = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert ran.stdout == "https://abc123xyz-8441.proxy.runpod.net\n"
    outside = subprocess.run(argv, env={"PATH": os.environ["PATH"]}, capture_output=True, text=True)
    assert outside.returncode != 0
    assert "RUNPOD_POD_ID" in outside.stderr


def test_runpod_template_and_the_images_own_command(make_runpod, runpod_api):
    """A template alone may give the image; command `none` keeps the image's CMD."""
    make_runpod(image="", template_id="tpl123", command="none").create(spec("gpu"))
    body = runpod_api.calls_to("POST", "/pods")[0].body
    assert body["templateId"] == "tpl123"
    assert "imageName" not in body
    assert "dockerStartCmd" not in body


def test_runpod_list_finds_the_pools_pods_by_name(make_runpod, runpod_api):
    """Another pool's pod, a pod of someone else's and a terminated one are not listed."""
    provider = make_runpod()
    mine = provider.create(spec("gpu"))
    runpod_api.add_pod("polyserve-cpu-11111111")
    runpod_api.add_pod("jupyter-notebook")
    runpod_api.add_pod("polyserve-gpu-22222222", status="TERMINATED")
    runpod_api.add_pod("polyserve-gpu-33333333", status="EXITED")
    listed = {m.host_id: m.state for m in provider.list("gpu")}
    assert listed == {mine.host_id: "RUNNING", "polyserve-gpu-33333333": "EXITED"}


def test_runpod_created_at_comes_from_the_pod(make_runpod, runpod_api):
    provider = make_runpod()
    provider.create(spec("gpu"))
    runpod_api.by_name("polyserve-gpu-0a1b2c3d")["lastStartedAt"] = "2026-01-02T03:04:05Z"
    runpod_api.add_pod("polyserve-gpu-44444444")["createdAt"] = "2026-01-02 03:04:06.5 +0000 UTC"
    ages = {m.host_id: m.created_at for m in provider.list("gpu")}
    assert ages == {"polyserve-gpu-0a1b2c3d": 1767323045.0, "polyserve-gpu-44444444": 1767323046.5}


def test_runpod_refuses_a_host_id_without_the_pools_prefix(make_runpod, runpod_api):
    with pytest.raises(ProviderError, match="does not start with polyserve-gpu-"):
        make_runpod().create(spec("gpu", host_id="polyserve-cpu-1"))
    assert runpod_api.calls == []


def test_runpod_take_out_calls_nothing(make_runpod, runpod_api):
    provider = make_runpod()
    machine = provider.create(spec("gpu"))
    before = len(runpod_api.calls)
    provider.take_out(machine)
    assert len(runpod_api.calls) == before


def test_runpod_stop_waits_until_the_pod_has_exited(make_runpod, runpod_api):
    provider = make_runpod()
    machine = provider.create(spec("gpu"))
    runpod_api.polls_until_exited = 3
    provider.stop(machine, timeout_s=30)
    assert len(runpod_api.calls_to("POST", r"/pods/[a-z0-9]+/stop")) == 1
    assert runpod_api.pods[machine.id]["desiredStatus"] == "EXITED"


def test_runpod_stop_gives_up_after_its_timeout(make_runpod, runpod_api, caplog):
    provider = make_runpod()
    machine = provider.create(spec("gpu"))
    runpod_api.polls_until_exited = None
    provider.stop(machine, timeout_s=0.05)
    assert runpod_api.pods[machine.id]["desiredStatus"] == "RUNNING"
    assert "still running after" in caplog.text


def test_runpod_stop_of_an_exited_pod_asks_nothing(make_runpod, runpod_api):
    provider = make_runpod()
    machine = provider.create(spec("gpu"))
    runpod_api.pods[machine.id]["desiredStatus"] = "EXITED"
    provider.stop(machine, timeout_s=30)
    assert runpod_api.calls_to("POST", r"/pods/[a-z0-9]+/stop") == []


def test_runpod_delete_terminates_and_twice_is_fine(make_runpod, runpod_api):
    provider = make_runpod()
    machine = provider.create(spec("gpu"))
    provider.delete(machine)
    assert runpod_api.pods == {}
    provider.delete(machine)  # 404: already gone
    provider.stop(machine, timeout_s=30)  # and stopping a gone pod is no error either
    assert len(runpod_api.calls_to("DELETE", r"/pods/[a-z0-9]+")) == 2


@pytest.mark.parametrize("failure", ["unauthorized", "server error", "unreachable"])
@pytest.mark.parametrize("call", ["create", "list", "delete"])
def test_runpod_errors_are_provider_errors_without_secrets(
    make_runpod, runpod_api, caplog, failure, call
):
    caplog.set_level(logging.DEBUG)
    seen: list[str] = []
    if failure == "unauthorized":
        provider = make_runpod(key="rpa_not_the_right_key_" + random_token(8))
    elif failure == "server error":
        provider = make_runpod()
        runpod_api.fail = echo(lambda m: {"error": m, "status": 500}, seen)
    else:
        provider = make_runpod(api_url=closed_port_url())
    with pytest.raises(ProviderError) as raised:
        act(provider, call, "gpu", machine_id="abc")
    message = str(raised.value)
    assert message.startswith("runpod: ")
    assert {"unauthorized": "HTTP 401", "server error": "HTTP 500"}.get(
        failure, "cannot reach 127.0.0.1"
    ) in message
    if failure == "server error":
        assert RUNPOD_KEY in seen[0]
        assert (DB_URL in seen[0]) == (call == "create")
        assert "<redacted>" in message
    assert_no_secrets(message, "".join(traceback.format_exception(raised.value)), caplog.text)
    assert_no_secrets(repr(provider))


def test_runpod_make_without_the_key_names_the_variable(monkeypatch):
    monkeypatch.delenv("RUNPOD_API_KEY", raising=False)
    values = read(runpod.SETTINGS, {"POLYSERVE_RUNPOD_IMAGE": "x"})
    with pytest.raises(ProviderError, match="RUNPOD_API_KEY is not set"):
        runpod.make(values)


def test_runpod_make_without_an_image_or_template_says_so(monkeypatch):
    monkeypatch.setenv("RUNPOD_API_KEY", RUNPOD_KEY)
    with pytest.raises(ProviderError, match="POLYSERVE_RUNPOD_IMAGE and"):
        runpod.make(read(runpod.SETTINGS, {}))


def test_secret_values_include_the_forms_an_api_may_quote():
    """A database URL is redacted as sent, JSON-escaped, and its password alone."""
    url = 'postgresql://ps:p%40ss"w@db/ps'
    found = cloud.secret_values({"POLYSERVE_DATABASE_URL": url, "POLYSERVE_POOL": "gpu"})
    assert found == [url, 'postgresql://ps:p%40ss\\"w@db/ps', 'p@ss"w']
    redact = cloud.Redactor("the-api-token")
    text = f'bad value "{json.dumps(url)}" (password p@ss"w) from the-api-token'
    assert redact(text, found) == 'bad value ""<redacted>"" (password <redacted>) from <redacted>'


# -- settings --


@pytest.mark.parametrize("module", [hetzner, runpod])
def test_provider_settings_are_prefixed_and_documented(module):
    prefix = module.__name__.rsplit(".", 1)[-1] + "_"
    assert all(s.name.startswith(prefix) and s.doc for s in module.SETTINGS)
    table = markdown_table(module.SETTINGS)
    assert f"`POLYSERVE_{prefix.upper()}PORT` | `8441`" in table


@pytest.mark.parametrize("module", [hetzner, runpod])
def test_providers_doc_settings_tables_are_generated_from_the_declarations(module):
    name = module.__name__.rsplit(".", 1)[-1]
    doc = (REPO / "docs" / "providers.md").read_text()
    begin, end = f"<!-- providers:{name}:begin -->\n", f"\n<!-- providers:{name}:end -->"
    assert doc.split(begin)[1].split(end)[0] == markdown_table(module.SETTINGS)


def test_provider_settings_parse_and_name_a_bad_value():
    assert read(runpod.SETTINGS, {"POLYSERVE_RUNPOD_CLOUD_TYPE": "community"})[
        "runpod_cloud_type"
    ] == ("COMMUNITY")
    with pytest.raises(ValueError, match="POLYSERVE_HETZNER_PORT='70000'"):
        read(hetzner.SETTINGS, {"POLYSERVE_HETZNER_PORT": "70000"})
    with pytest.raises(ValueError, match="POLYSERVE_RUNPOD_CLOUD_TYPE='cheap'"):
        read(runpod.SETTINGS, {"POLYSERVE_RUNPOD_CLOUD_TYPE": "cheap"})


def test_provider_modules_import_without_their_sdks():
    """config.py imports every provider module to read its settings: the SDKs stay out."""
    code = (
        "import sys; sys.modules['hcloud'] = None; sys.modules['requests'] = None\n"
        "from polyserve.autoscale import hetzner, runpod\n"
        "print(len(hetzner.SETTINGS) + len(runpod.SETTINGS))"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert int(ran.stdout) == len(hetzner.SETTINGS) + len(runpod.SETTINGS)
