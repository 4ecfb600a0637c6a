"""Per-space dependencies on a real 1-worker host: two versions of one package served
side by side from the same worker, and the host's own imports unchanged after it all."""

from __future__ import annotations

import hashlib
import importlib.metadata
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import HOST_FIXTURES, HostProcess, make_tar
from tests.wheels import TESTPKG, wheelhouse

USES_TESTPKG = (
    "import os\n"
    "import polyserve_testpkg as t\n"
    "from polyserve_testpkg import sub\n"
    "def handle(request):\n"
    "    import polyserve_testpkg as lazy  # at request time, through the version's builtins\n"
    "    return {'version': t.__version__, 'lazy': lazy.__version__,"
    " 'metadata': t.metadata_version, 'sub': sub.WHO, 'pid': os.getpid()}\n"
)
# A space without dependencies that reports what the host's own imports find.
HOST_VIEW = (
    "import importlib.metadata, os, sys\n"
    "def handle(request):\n"
    "    try:\n"
    "        import polyserve_testpkg\n"
    "        found = polyserve_testpkg.__file__\n"
    "    except ImportError:\n"
    "        found = None\n"
    "    try:\n"
    f"        meta = importlib.metadata.version({TESTPKG!r})\n"
    "    except importlib.metadata.PackageNotFoundError:\n"
    "        meta = None\n"
    "    return {'import': found, 'metadata': meta, 'pid': os.getpid(),\n"
    "            'numpy': importlib.metadata.version('numpy'),\n"
    "            'real_names': sorted(n for n in sys.modules if 'polyserve_testpkg' in n\n"
    "                                 and not n.startswith('_ps_'))}\n"
)

HOST_FIXTURES.add("deps_host")


def site_packages_digest() -> str:
    """Every file name and size under the host's site-packages: what an install changes."""
    root = Path(sysconfig.get_paths()["purelib"])
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if "__pycache__" not in path.parts and path.is_file():
            h.update(f"{path.relative_to(root)} {path.stat().st_size}\n".encode())
    return h.hexdigest()


@pytest.fixture(scope="module")
def deps_host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostProcess]:
    wheels = wheelhouse(tmp_path_factory.mktemp("wheels"))
    host = HostProcess(
        tmp_path_factory.mktemp("deps") / "data",
        workers=1,
        POLYSERVE_DEPS_OFFLINE="1",
        POLYSERVE_DEPS_FIND_LINKS=str(wheels),
    )
    try:
        yield host.start()
    finally:
        host.stop()


def deploy(host: HostProcess, space: str, files: dict[str, str]) -> dict:
    r = host.deploy(space, make_tar(files), filename="space.tar")
    assert r.status_code == 200, r.text
    return r.json()


def test_two_spaces_pinned_to_two_versions_answer_from_the_same_worker(deps_host):
    site_before = site_packages_digest()
    for version in ("1.0", "2.0"):
        files = {"main.py": USES_TESTPKG, "requirements.txt": f"{TESTPKG}=={version}\n"}
        answer = deploy(deps_host, f"deps/v{version[0]}", files)
        assert answer["dependencies"]["installed"] == [f"{TESTPKG}=={version}"]
    one = deps_host.get("/s/deps/v1/").json()
    two = deps_host.get("/s/deps/v2/").json()
    assert one["pid"] == two["pid"]  # one worker holds both at once
    for answer, version in ((one, "1.0"), (two, "2.0")):
        assert answer["version"] == answer["lazy"] == answer["metadata"] == version
        assert answer["sub"] == f"sub of {version}"
    # Both still loaded: asked again, each answers with its own.
    assert deps_host.get("/s/deps/v1/").json()["version"] == "1.0"
    assert deps_host.get("/s/deps/v2/").json()["version"] == "2.0"

    # A third space with the first set: nothing installed, the same set shared.
    files = {"main.py": USES_TESTPKG, "polyserve.toml": f'dependencies = ["{TESTPKG}==1.0"]\n'}
    third = deploy(deps_host, "deps/v1-again", files)["dependencies"]
    assert third["cached"] is True and third["installed"] == []
    assert deps_host.get("/s/deps/v1-again/").json()["version"] == "1.0"

    # The host's own imports are unchanged after it all: a fresh space without
    # dependencies, in the same worker, finds neither version, and the host's numpy.
    deploy(deps_host, "deps/plain", {"main.py": HOST_VIEW})
    view = deps_host.get("/s/deps/plain/").json()
    assert view["pid"] == one["pid"]
    assert view["import"] is None and view["metadata"] is None and view["real_names"] == []
    assert view["numpy"] == importlib.metadata.version("numpy")
    assert site_packages_digest() == site_before  # nothing was installed into the host


def test_a_conflict_with_the_hosts_numpy_changes_nothing_on_a_real_host(deps_host):
    deploy(deps_host, "deps/keep", {"main.py": "def handle(r):\n    return 'v1'\n"})
    files = {"main.py": USES_TESTPKG, "requirements.txt": "polyserve-oldnumpy\n"}
    r = deps_host.deploy("deps/keep", make_tar(files), filename="space.tar")
    assert r.status_code == 422
    body = r.json()
    assert body["package"] == "numpy" and body["requested"] == "<1"
    assert body["host_version"] == importlib.metadata.version("numpy")
    assert deps_host.get("/s/deps/keep/").text == "v1"


def test_a_dependency_shipping_its_own_starlette_is_refused_on_a_real_host(deps_host):
    """polyserve-shadow's wheel carries a `starlette` package: had it been installed, the
    space's `import starlette` would have been the forged one."""
    deploy(deps_host, "deps/shadow", {"main.py": "def handle(r):\n    return 'v1'\n"})
    main = "import starlette\ndef handle(request):\n    return {'forged': starlette.FORGED}\n"
    files = {"main.py": main, "requirements.txt": "polyserve-shadow\n"}
    r = deps_host.deploy("deps/shadow", make_tar(files), filename="space.tar")
    assert r.status_code == 422, r.text
    body = r.json()
    assert (body["package"], body["module"]) == ("polyserve-shadow", "starlette")
    assert deps_host.get("/s/deps/shadow/").text == "v1"
