"""Kept versions called by name on a real host: `/s/owner/name@N/` and the protocol's
`versions/N`, beside the current version, metered as the space, pinned against pruning."""

from __future__ import annotations

import json

import httpx2 as httpx

from polyserve.state.store import Store
from tests.helpers import HostProcess, module_host, until
from tests.onnx_models import add

KEEP = 2  # versions kept per space: a third deploy prunes the first unless it is pinned
host = module_host("host", POLYSERVE_KEEP_VERSIONS=str(KEEP))


def source(text: str) -> str:
    return (
        f"import os\n\ndef handle(request):\n    return {{'text': {text!r}, 'pid': os.getpid()}}\n"
    )


def deploy(host: HostProcess, space: str, content: str | bytes, filename: str = "main.py") -> int:
    answer = host.deploy(space, content, filename=filename)
    assert answer.status_code == 200, answer.text
    return int(answer.json()["version"])


def text(host: HostProcess, path: str) -> str:
    answer = host.get(path)
    assert answer.status_code == 200, (path, answer.text)
    return str(answer.json()["text"])


def requests(host: HostProcess, space: str) -> int:
    return int(host.get("/_polyserve/usage").json()["spaces"][space]["requests"])


def pin(host: HostProcess, space: str, number: int) -> None:
    """Store.pin on the host's data directory: the internal API a rollout uses."""
    store = Store(host.data_dir, max_spaces=64)
    with store.locked():
        store.pin(space, number)


def test_a_kept_version_by_name_serves_beside_the_current_one_in_every_worker(host):
    assert deploy(host, "pin/two", source("one")) == 1
    assert deploy(host, "pin/two", source("two")) == 2
    pids: dict[str, set[int]] = {"@1": set(), "": set()}

    def both_workers_answered() -> bool:
        for suffix, wanted in (("@1", "one"), ("", "two")):
            answer = host.get(f"/s/pin/two{suffix}/").json()
            assert answer["text"] == wanted, (suffix, answer)
            pids[suffix].add(answer["pid"])
        return all(len(seen) == host.workers for seen in pids.values())

    until(both_workers_answered, what="both workers serving v1 by name and v2 plain")
    assert text(host, "/s/pin/two@2/") == "two"
    assert text(host, "/s/pin/two@current/") == "two"
    assert text(host, "/s/pin/two/") == "two"
    # A deploy moves the plain URL at once, with v1 loaded by name in every worker, and
    # leaves v1 serving by name.
    assert deploy(host, "pin/two", source("three")) == 3
    for _ in range(4 * host.workers):
        assert text(host, "/s/pin/two/") == "three"
        assert text(host, "/s/pin/two@1/") == "one"
        assert text(host, "/s/pin/two@2/") == "two"


def test_what_a_version_by_name_logs_carries_its_version(host):
    speaking = "def handle(request):\n    print('said by {n}')\n    return {{'text': '{n}'}}\n"
    deploy(host, "pin/logs", speaking.format(n="one"))
    deploy(host, "pin/logs", speaking.format(n="two"))
    assert text(host, "/s/pin/logs@1/") == "one"
    assert text(host, "/s/pin/logs/") == "two"

    def both_said() -> list[dict]:
        found = host.get("/_polyserve/spaces/pin/logs/logs").json()["records"]
        return found if len(found) >= 2 else []

    said = {r["message"]: r["version"] for r in until(both_said, what="two records")}
    assert said == {"said by one": 1, "said by two": 2}, said


def test_requests_to_a_version_by_name_count_for_the_space(host):
    deploy(host, "pin/meter", source("one"))
    deploy(host, "pin/meter", source("two"))
    before = requests(host, "pin/meter")
    for _ in range(5):
        assert text(host, "/s/pin/meter@1/") == "one"
    for _ in range(3):
        assert text(host, "/s/pin/meter/") == "two"
    assert requests(host, "pin/meter") == before + 8


def test_a_version_the_space_does_not_keep_is_a_404_listing_the_kept_ones(host):
    for text_ in ("one", "two", "three"):
        deploy(host, "pin/gone", source(text_))
    for version in ("1", "7", "abc", "01", ""):
        # v1 is pruned by the third deploy (keep_versions 2), once no worker holds it.
        answer = until(
            lambda v=version: (r := host.get(f"/s/pin/gone@{v}/")).status_code == 404 and r,
            what=f"@{version} answered 404",
        )
        body = answer.json()
        assert body["kept"] == [2, 3], body
        assert "@N" in body["error"] and body["space"] == "pin/gone"
    assert text(host, "/s/pin/gone@2/") == "two"


def test_a_pinned_version_survives_the_pruning_of_later_deploys(host):
    deploy(host, "pin/kept", source("one"))
    pin(host, "pin/kept", 1)
    for text_ in ("two", "three", "four"):
        deploy(host, "pin/kept", source(text_))
    versions = host.get("/_polyserve/spaces/pin/kept/versions").json()
    assert [v["version"] for v in versions["versions"]] == [1, 3, 4], versions
    assert text(host, "/s/pin/kept@1/") == "one"
    assert text(host, "/s/pin/kept/") == "four"


def test_the_protocol_route_with_a_version_reaches_that_version_of_a_model(host):
    deploy(host, "pin/model", add(1.0), filename="model.onnx")
    deploy(host, "pin/model", add(2.0), filename="model.onnx")
    tensor = {"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [0, 0, 0, 0]}
    payload = json.dumps({"inputs": [tensor]}).encode()

    def infer(path: str) -> tuple[str, list[float]]:
        answer = httpx.post(host.url + path, content=payload, timeout=30)
        assert answer.status_code == 200, (path, answer.text)
        return answer.json()["model_version"], answer.json()["outputs"][0]["data"]

    assert infer("/v2/models/pin/model/versions/1/infer") == ("1", [1.0] * 4)
    assert infer("/v2/models/pin/model/versions/2/infer") == ("2", [2.0] * 4)
    assert infer("/v2/models/pin/model/infer") == ("2", [2.0] * 4)
    assert infer("/s/pin/model@1/v2/models/model/infer") == ("1", [1.0] * 4)
    assert infer("/s/pin/model@1/v2/models/model/versions/1/infer") == ("1", [1.0] * 4)
    meta = host.get("/v2/models/pin/model/versions/1")
    assert meta.status_code == 200 and meta.json()["versions"] == ["1", "2"], meta.text
    missing = httpx.post(host.url + "/v2/models/pin/model/versions/9/infer", content=payload)
    assert missing.status_code == 404 and missing.json()["kept"] == [1, 2], missing.text
    assert requests(host, "pin/model") == 5  # every infer, the unknown version's not


def test_deleting_the_space_makes_a_version_by_name_a_404(host):
    deploy(host, "pin/deleted", source("one"))
    deploy(host, "pin/deleted", source("two"))
    for _ in range(2 * host.workers):  # loaded by name in the workers it reaches
        assert text(host, "/s/pin/deleted@1/") == "one"
    gone = httpx.delete(host.url + "/_polyserve/spaces/pin/deleted", timeout=30)
    assert gone.status_code == 200, gone.text
    for _ in range(2 * host.workers):
        answer = host.get("/s/pin/deleted@1/")
        assert answer.status_code == 404, answer.text
        assert "not deployed" in answer.json()["error"]


def test_a_version_deployed_with_current_false_outlasts_later_deploys_for_its_rollout(host):
    deploy(host, "pin/waits", source("one"))
    answer = httpx.post(
        host.url + "/_polyserve/deploy",
        data={"space": "pin/waits", "current": "false"},
        files={"module": ("main.py", source("new").encode())},
        timeout=60,
    )
    assert answer.status_code == 200 and answer.json()["version"] == 2, answer.text
    for text_ in ("three", "four", "five"):  # more plain deploys than keep_versions (2)
        deploy(host, "pin/waits", source(text_))
    versions = host.get("/_polyserve/spaces/pin/waits/versions").json()
    assert [v["version"] for v in versions["versions"]] == [2, 4, 5], versions
    started = httpx.post(
        host.url + "/_polyserve/spaces/pin/waits/rollout",
        json={"version": 2, "steps": [50, 100], "step_s": 3600},
        timeout=30,
    )
    assert started.status_code == 200, started.text
    # 100 requests at 50%: one version alone would be a chance of 1e-30.
    seen = {text(host, "/s/pin/waits/") for _ in range(100)}
    assert seen == {"new", "five"}, seen
