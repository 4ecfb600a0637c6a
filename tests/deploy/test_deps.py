"""Per-space dependencies without a gunicorn host: what a space may declare, the host's
packages winning, per-version isolation in one process, and every bad input refused."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from starlette.testclient import TestClient

from polyserve import settings
from polyserve.app import create_app
from polyserve.deploy import deps, requirements, uvinstall
from polyserve.errors import ClientError
from polyserve.serve import loader
from tests.helpers import make_tar
from tests.wheels import TESTPKG, compiled_wheel, make_testpkg, wheel, wheelhouse

NUMPY = importlib.metadata.version("numpy")
USES_TESTPKG = (
    "import polyserve_testpkg as t\n"
    "from polyserve_testpkg import sub\n"
    "def handle(request):\n"
    "    return {'version': t.__version__, 'metadata': t.metadata_version, 'sub': sub.WHO}\n"
)
V1 = "def handle(request):\n    return 'v1'\n"


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wheelhouse(tmp_path_factory.mktemp("wheels"))


def offline(data: Path, wheels: Path, **env: str) -> settings.Settings:
    return settings.load(
        {
            "POLYSERVE_DATA_DIR": str(data),
            "POLYSERVE_DEPS_OFFLINE": "1",
            "POLYSERVE_DEPS_FIND_LINKS": str(wheels),
            "POLYSERVE_IMPORT_TIMEOUT": "20",
            **env,
        }
    )


def space_dir(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "space"
    root.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def read(tmp_path: Path, files: dict[str, str], **env: str) -> requirements.Requested | None:
    return requirements.read(space_dir(tmp_path, files), settings.load(env))


# -- reading a declaration -------------------------------------------------------------


def test_no_declaration_is_no_dependencies(tmp_path):
    assert read(tmp_path, {"main.py": V1}) is None


def test_requirements_txt_lines_comments_and_continuations_are_read(tmp_path):
    text = (
        "# a comment\npolyserve-testpkg \\\n  ==1.0  # pinned\n\n"
        "idna-nothing>=1 ; python_version >= '3'\n"
    )
    requested = read(tmp_path, {"requirements.txt": text})
    assert requested.source == "requirements.txt"
    assert requested.lines == ("polyserve-testpkg==1.0", 'idna-nothing>=1; python_version >= "3"')


def test_polyserve_toml_dependencies_win_over_requirements_txt(tmp_path):
    """`dependencies` in polyserve.toml wins, even empty: requirements.txt is then not
    read (a tar may carry one for other tools)."""
    files = {"requirements.txt": "-e .\n", "polyserve.toml": 'dependencies = ["pkg-a==1"]\n'}
    assert read(tmp_path, files).lines == ("pkg-a==1",)
    files["polyserve.toml"] = "dependencies = []\n"
    requested = read(tmp_path, files)
    assert requested.source == "polyserve.toml" and requested.lines == ()
    files["polyserve.toml"] = 'entry = "main.py"\n'  # no `dependencies` key: the file is read
    with pytest.raises(ClientError, match="option -e is not accepted"):
        read(tmp_path, files)


def test_a_hash_option_after_a_requirement_is_kept(tmp_path):
    line = "pkg-a==1.0 --hash=sha256:" + "a" * 64
    assert read(tmp_path, {"requirements.txt": line + "\n"}).lines == (line,)


def test_the_hosts_own_index_url_is_accepted_as_a_no_op(tmp_path):
    text = "--index-url https://mirror.example/simple/\npkg-a\n"
    env = {"POLYSERVE_DEPS_INDEX_URL": "https://mirror.example/simple"}
    assert read(tmp_path, {"requirements.txt": text}, **env).lines == ("pkg-a",)


REACHING_OUTSIDE = [
    ("-e .", "option -e"),
    ("--editable=./x", "option --editable"),
    ("-e git+https://example.org/x.git#egg=x", "option -e"),
    ("--index-url https://evil.example/simple", "option --index-url"),
    ("-i https://evil.example/simple", "option -i"),
    ("--extra-index-url https://evil.example/simple", "option --extra-index-url"),
    ("-f /tmp/wheels", "option -f"),
    ("--find-links=https://evil.example/", "option --find-links"),
    ("-r /etc/passwd", "option -r"),
    ("-c other.txt", "option -c"),
    ("--trusted-host evil.example", "option --trusted-host"),
    ("./local/project", "local paths"),
    ("/abs/project", "local paths"),
    ("../up", "local paths"),
    ("file:///etc/passwd", "file: URLs"),
    ("git+https://example.org/x.git", "version-control URLs"),
    ("https://example.org/x-1.0-py3-none-any.whl", "URLs"),
    ("x @ https://example.org/x-1.0.tar.gz", "direct references"),
    ("x @ file:///tmp/x", "direct references"),
    ("pkg.whl", "archive files"),
    ("pkg-a==1 --config-settings x=y", "only --hash"),
    ("not a requirement ===", "not a requirement"),
]


@pytest.mark.parametrize(("line", "words"), REACHING_OUTSIDE)
def test_requirement_lines_that_reach_outside_are_refused(tmp_path, line, words):
    with pytest.raises(ClientError) as caught:
        read(tmp_path, {"requirements.txt": f"pkg-ok\n{line}\n"})
    assert caught.value.status == 422
    assert words in caught.value.error and "line 2" in caught.value.error


def test_polyserve_toml_dependencies_must_be_a_list_of_strings(tmp_path):
    with pytest.raises(ClientError, match="array of requirement strings"):
        read(tmp_path, {"polyserve.toml": 'dependencies = "requests"\n'})
    with pytest.raises(ClientError, match="direct references"):
        read(tmp_path, {"polyserve.toml": 'dependencies = ["x @ https://e.org/x.whl"]\n'})


# -- the host's packages win ------------------------------------------------------------


def test_a_requirement_the_host_satisfies_is_not_installed(tmp_path):
    requested = read(tmp_path, {"requirements.txt": f"numpy>={NUMPY}\npkg-a\n"})
    assert requested.lines == ("pkg-a",)
    assert requested.from_host == (f"numpy=={NUMPY}",)


def test_a_requirement_conflicting_with_the_hosts_numpy_names_both_versions(tmp_path):
    with pytest.raises(ClientError) as caught:
        read(tmp_path, {"requirements.txt": "numpy<1\n"})
    assert caught.value.status == 422
    assert caught.value.details["package"] == "numpy"
    assert caught.value.details["requested"] == "<1"
    assert caught.value.details["host_version"] == NUMPY
    assert "numpy<1" in caught.value.error and NUMPY in caught.value.error


def test_an_extra_of_a_host_package_asks_for_what_the_extra_adds(tmp_path):
    """starlette[full] is the host's starlette plus the extra's packages: each of those
    is the host's too, or installed."""
    requested = read(tmp_path, {"requirements.txt": "starlette[full]\n"})
    extra = set()
    for line in requirements.host_packages()["starlette"].requires or ():
        r = Requirement(line)
        if r.marker and r.marker.evaluate({"extra": "full"}) and not r.marker.evaluate():
            extra.add(canonicalize_name(r.name))
    asked = {canonicalize_name(Requirement(line).name) for line in requested.lines}
    from_host = {pin.split("==")[0] for pin in requested.from_host}
    assert "starlette" in from_host
    assert extra and asked | (from_host - {"starlette"}) == extra
    assert not asked & set(requirements.host_packages())


# -- isolation in one process -----------------------------------------------------------


def install(requested: requirements.Requested, s: settings.Settings) -> deps.Installed:
    return asyncio.run(deps.install(requested, Path(s.data_dir), s))


def test_two_versions_of_one_package_are_imported_side_by_side(tmp_path, wheels):
    """Two spaces pinned to 1.0 and 2.0 each import their own, in this one process, at
    the same time: their modules import each other by their real names and read their
    own version through importlib.metadata."""
    s = offline(tmp_path / "data", wheels)
    imported = {}
    for version in ("1.0", "2.0"):
        root = space_dir(tmp_path / version, {"main.py": USES_TESTPKG})
        (root / "requirements.txt").write_text(f"{TESTPKG}=={version}\n")
        installed = install(requirements.read(root, s), s)
        assert installed.packages == [f"{TESTPKG}=={version}"]
        imported[version] = loader.import_version(
            f"o/v{version[0]}", 1, root, "main.py", deps=installed.site
        )
    try:
        for version, space in imported.items():
            module = space.module
            assert module.t.__version__ == version
            assert module.t.metadata_version == version
            assert f"sub of {version}" == module.sub.WHO
        assert imported["1.0"].module.t is not imported["2.0"].module.t
        # Nothing of theirs under the real name: the host does not see them.
        assert "polyserve_testpkg" not in sys.modules
        with pytest.raises(ModuleNotFoundError):
            __import__("polyserve_testpkg")
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version(TESTPKG)
        assert importlib.metadata.version("numpy") == NUMPY
    finally:
        for space in imported.values():
            loader.forget(space.package)


def test_a_versions_own_module_shadows_a_dependency_of_the_same_name(tmp_path, wheels):
    s = offline(tmp_path / "data", wheels)
    root = space_dir(
        tmp_path,
        {
            "main.py": "import polyserve_testpkg\ndef handle(r):\n    return 1\n",
            "polyserve_testpkg.py": "__version__ = 'mine'\n",
            "requirements.txt": f"{TESTPKG}==1.0\n",
        },
    )
    installed = install(requirements.read(root, s), s)
    space = loader.import_version("o/s", 1, root, "main.py", deps=installed.site)
    try:
        assert space.module.polyserve_testpkg.__version__ == "mine"
    finally:
        loader.forget(space.package)


def test_a_space_without_dependencies_sees_only_the_hosts_metadata(tmp_path, wheels):
    s = offline(tmp_path / "data", wheels)
    with_deps = space_dir(tmp_path / "a", {"main.py": USES_TESTPKG})
    (with_deps / "requirements.txt").write_text(f"{TESTPKG}==2.0\n")
    installed = install(requirements.read(with_deps, s), s)
    a = loader.import_version("o/a", 1, with_deps, "main.py", deps=installed.site)
    plain = space_dir(
        tmp_path / "b",
        {
            "main.py": (
                "import importlib.metadata as m\n"
                "def versions():\n"
                "    try:\n"
                f"        mine = m.version({TESTPKG!r})\n"
                "    except m.PackageNotFoundError:\n"
                "        mine = None\n"
                "    return mine, m.version('numpy')\n"
                "def handle(r):\n    return 1\n"
            )
        },
    )
    b = loader.import_version("o/b", 1, plain, "main.py")
    try:
        assert b.module.versions() == (None, NUMPY)
    finally:
        loader.forget(a.package)
        loader.forget(b.package)


# -- deploys, in process ----------------------------------------------------------------


@pytest.fixture
def inproc(tmp_path, wheels) -> Iterator[tuple[TestClient, Path]]:
    data = tmp_path / "data"
    with TestClient(create_app(offline(data, wheels)), client=("127.0.0.1", 1)) as c:
        assert deploy(c, "o/s", {"main.py": V1}).status_code == 200
        yield c, data


def deploy(c: TestClient, space: str, files: dict[str, str]):
    return c.post(
        "/_polyserve/deploy",
        data={"space": space},
        files={"module": ("space.tar", make_tar(files))},
    )


def test_a_deploy_installs_a_package_the_host_lacks_then_the_same_set_installs_nothing(inproc):
    c, data = inproc
    files = {"main.py": USES_TESTPKG, "requirements.txt": f"{TESTPKG}==1.0\nnumpy\n"}
    first = deploy(c, "o/s", files)
    assert first.status_code == 200, first.text
    answer = first.json()["dependencies"]
    assert answer["installed"] == [f"{TESTPKG}==1.0"] and answer["cached"] is False
    assert answer["from_host"] == [f"numpy=={NUMPY}"]
    assert answer["install_ms"] > 0
    assert c.get("/s/o/s/").json()["version"] == "1.0"
    again = deploy(c, "o/other", files).json()["dependencies"]
    assert again["installed"] == [] and again["cached"] is True and again["install_ms"] == 0
    assert again["set"] == answer["set"] and again["packages"] == answer["packages"]
    assert len(list((data / "deps" / "sets").iterdir())) == 1
    # The version's metadata names the set: a worker imports it from there.
    meta = json.loads((data / "spaces/o/other/versions/1.json").read_text())
    assert meta["dependencies"]["set"] == answer["set"]


def test_a_missing_dependency_is_a_422_at_deploy(inproc):
    c, _ = inproc
    r = deploy(c, "o/s", {"main.py": USES_TESTPKG})  # imports what it does not declare
    assert r.status_code == 422 and "polyserve_testpkg" in r.json()["error"]
    assert c.get("/s/o/s/").text == "v1"


BAD = [
    # (case, requirements.txt, main.py, status, words in the error)
    ("unresolvable", "polyserve-nothing-like-it==9\n", V1, 422, "cannot be resolved"),
    ("no-such-version", f"{TESTPKG}==3.0\n", V1, 422, "cannot be resolved"),
    ("conflicts-with-host-numpy", "numpy<1\n", V1, 422, f"host's numpy {NUMPY}"),
    ("transitive-host-conflict", "polyserve-oldnumpy\n", V1, 422, f"host's numpy {NUMPY}"),
    ("sdist-build-fails", "polyserve-badbuild\n", V1, 422, "building a dependency"),
    ("pth-file", "polyserve-pth\n", V1, 422, ".pth"),
    ("ships-starlette", "polyserve-shadow\n", V1, 422, "ships the module `starlette`"),
    ("ships-numpy", "polyserve-numpy-module\n", V1, 422, "ships the module `numpy`"),
    ("extra-conflict", "polyserve-extras[old]\n", V1, 422, "polyserve-extras[old] 1.0 asks"),
    ("extra-of-a-dependency", "polyserve-wants-old\n", V1, 422, "polyserve-extras[old] 1.0"),
    ("broken-at-import", "polyserve-broken\n", "import polyserve_broken\n" + V1, 422, "Import"),
    ("editable", "-e .\n", V1, 422, "option -e"),
    ("index-url", "--index-url https://evil.example/simple\n", V1, 422, "option --index-url"),
    ("extra-index", "--extra-index-url https://evil.example/s\n", V1, 422, "--extra-index-url"),
    ("find-links", "-f /tmp\n", V1, 422, "option -f"),
    ("local-path", "./vendored/pkg\n", V1, 422, "local paths"),
    ("file-url", "file:///etc/passwd\n", V1, 422, "file: URLs"),
    ("vcs-url", "git+https://example.org/x.git\n", V1, 422, "version-control"),
    ("direct-reference", "x @ https://example.org/x.whl\n", V1, 422, "direct references"),
]


@pytest.mark.parametrize(
    ("case", "requirements", "main", "status", "words"), BAD, ids=[b[0] for b in BAD]
)
def test_bad_dependencies_are_a_4xx_and_publish_nothing(
    inproc, case, requirements, main, status, words
):
    c, data = inproc
    r = deploy(c, "o/s", {"main.py": main, "requirements.txt": requirements})
    assert r.status_code == status, r.text
    assert words in json.dumps(r.json()), r.json()
    assert c.get("/s/o/s/").text == "v1"  # the previous version still answers
    assert sorted(p.name for p in (data / "spaces/o/s/versions").iterdir()) == ["1", "1.json"]
    assert not any((data / "staging").iterdir())
    assert not list((data / "deps").glob("tmp/*"))  # no half-installed set left
    assert str(data) not in r.text  # no host path in the answer


SHADOWING = [
    ("polyserve-shadow", "starlette"),  # a package directory
    ("polyserve-numpy-module", "numpy"),  # a module file
]


@pytest.mark.parametrize(("dist", "module"), SHADOWING)
def test_a_dependency_shipping_a_host_module_under_another_name_is_a_422(inproc, dist, module):
    """The distribution is not one of the host's, so uv installs it; what it ships at the
    top of the set would be the space's `import starlette`. The installed files decide."""
    c, _ = inproc
    main = f"import {module}\ndef handle(request):\n    return {{'forged': {module}.FORGED}}\n"
    r = deploy(c, "o/s", {"main.py": main, "requirements.txt": f"{dist}\n"})
    assert r.status_code == 422, r.text
    body = r.json()
    assert (body["package"], body["module"], body["host_package"]) == (dist, module, module)
    assert f"{dist} 1.0 ships the module `{module}`" in body["error"]
    assert c.get("/s/o/s/").text == "v1"


def test_a_host_conflict_reached_through_an_extra_is_a_422(inproc):
    """polyserve-extras asks for numpy<1 only in its extra `old`: without the extra it
    installs; with it, asked by the space or by another dependency, it is refused."""
    c, _ = inproc
    fine = deploy(c, "o/fine", {"main.py": V1, "requirements.txt": "polyserve-extras\n"})
    assert fine.status_code == 200, fine.text
    assert fine.json()["dependencies"]["installed"] == ["polyserve-extras==1.0"]
    for requirement in ("polyserve-extras[old]", "polyserve-wants-old"):
        r = deploy(c, "o/s", {"main.py": V1, "requirements.txt": f"{requirement}\n"})
        assert r.status_code == 422, r.text
        body = r.json()
        assert (body["package"], body["requested"], body["host_version"]) == ("numpy", "<1", NUMPY)
        assert body["requested_by"] == "polyserve-extras[old] 1.0"
    assert c.get("/s/o/s/").text == "v1"


def test_a_set_over_the_size_limit_is_a_413(tmp_path):
    wheels = tmp_path / "big-wheels"
    wheels.mkdir()
    # Random bytes do not compress: a 2 MiB wheel installs to 2 MiB.
    wheel(wheels, "polyserve-big", "1.0", {"polyserve_big/blob.bin": os.urandom(2 << 20)})
    data = tmp_path / "data"
    s = offline(data, wheels, POLYSERVE_DEPS_MAX_MB="1")
    with TestClient(create_app(s), client=("127.0.0.1", 1)) as c:
        r = deploy(c, "o/s", {"main.py": V1, "requirements.txt": "polyserve-big\n"})
        assert r.status_code == 413 and "POLYSERVE_DEPS_MAX_MB" in r.json()["error"]
        assert not (data / "spaces/o/s").exists()
        assert not any((data / "deps" / "sets").iterdir())


@pytest.fixture
def silent_index() -> Iterator[str]:
    """A package index on loopback that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}/simple"
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


def test_an_index_that_does_not_answer_is_a_4xx_within_the_time_limit(tmp_path, silent_index):
    data = tmp_path / "data"
    s = settings.load(
        {
            "POLYSERVE_DATA_DIR": str(data),
            "POLYSERVE_DEPS_INDEX_URL": silent_index,
            "POLYSERVE_DEPS_TIMEOUT": "4",
        }
    )
    with TestClient(create_app(s), client=("127.0.0.1", 1)) as c:
        assert deploy(c, "o/s", {"main.py": V1}).status_code == 200
        r = deploy(c, "o/s", {"main.py": V1, "requirements.txt": "polyserve-anything\n"})
        assert r.status_code in (422, 424), r.text
        assert "index" in r.json()["error"]
        assert c.get("/s/o/s/").text == "v1"
        assert not list((data / "deps").glob("tmp/*"))


def test_uv_gets_none_of_the_hosts_secrets_or_uv_settings(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYSERVE_DEPLOY_TOKEN_SHA256", "f" * 64)
    monkeypatch.setenv("UV_INDEX_URL", "https://elsewhere.example/simple")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    env = uvinstall._uv_environ(tmp_path, settings.load({}))
    assert "POLYSERVE_DEPLOY_TOKEN_SHA256" not in env and "UV_INDEX_URL" not in env
    assert env["HTTPS_PROXY"] == "http://proxy.example:3128"  # the operator's proxy holds
    assert env["UV_CACHE_DIR"] == str(tmp_path / "uv-cache")


def test_a_fleet_hosts_pins_install_exactly_the_set_the_receiving_host_resolved(tmp_path, wheels):
    """A fleet host installs the pins a version's metadata carries: the same set under
    the same name as the receiving host's resolution, nothing resolved beyond the pins,
    nothing run once it is there, and uv's words when a pin is not in its find-links."""
    receiving = offline(tmp_path / "a", wheels)
    files = {"main.py": USES_TESTPKG, "requirements.txt": f"{TESTPKG}==2.0\n"}
    requested = requirements.read(space_dir(tmp_path, files), receiving)
    assert requested is not None
    resolved = asyncio.run(deps.install(requested, tmp_path / "a", receiving)).answer()

    extra = tmp_path / "extra"
    extra.mkdir()
    other = offline(tmp_path / "b", wheels, POLYSERVE_DEPS_FIND_LINKS=f"{wheels}:{extra}")
    pinned = asyncio.run(deps.install_pins(resolved, tmp_path / "b", other))
    assert (pinned.digest, pinned.packages) == (resolved["set"], resolved["packages"])
    assert pinned.installed == [f"{TESTPKG}==2.0"] and (pinned.site / "polyserve_testpkg").is_dir()
    again = asyncio.run(deps.install_pins(resolved, tmp_path / "b", other))
    assert again.installed == [] and again.digest == pinned.digest

    # No resolution of its own: a pin's dependencies come only as pins of their own.
    wheel(extra, "polyserve-needs", "1.0", {"polyserve_needs.py": ""}, (TESTPKG,))
    alone = asyncio.run(
        deps.install_pins({"packages": ["polyserve-needs==1.0"]}, tmp_path / "b", other)
    )
    assert alone.packages == ["polyserve-needs==1.0"]
    assert not (alone.site / "polyserve_testpkg").exists()

    with pytest.raises(ClientError) as refused:
        asyncio.run(deps.install_pins({"packages": [f"{TESTPKG}==9.0"]}, tmp_path / "b", other))
    assert refused.value.status == 422 and f"{TESTPKG}==9.0" in str(refused.value.details["uv"])
    assert not list((tmp_path / "b" / "deps" / "tmp").iterdir())  # nothing half-installed


def test_the_uv_binary_is_the_hosts_own_dependency():
    """uv comes with the host (the `uv` package), so no deploy depends on a PATH."""
    command = uvinstall.uv_command(Path("r"), Path("t"), Path("e"), settings.load({}))
    assert Path(command[0]).is_file()
    done = subprocess.run([command[0], "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("uv ")
    assert sys.executable in command and "--no-config" in command


def test_testpkg_wheels_carry_their_version(tmp_path):
    """The fixture itself: two wheels of one package that differ in __version__."""
    import zipfile

    for version in ("1.0", "2.0"):
        with zipfile.ZipFile(make_testpkg(tmp_path, version)) as z:
            assert f"__version__ = '{version}'" in z.read("polyserve_testpkg/__init__.py").decode()


# -- compiled extensions ----------------------------------------------------------------


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("compiled")
    if compiled_wheel(directory, "polyserve-ctest") is None:
        pytest.skip("no C compiler or Python headers: apt-get install gcc python3-dev")
    compiled_wheel(directory, "polyserve-cimport", imports_itself=True)
    return directory


USES_CTEST = "from polyserve_ctest import _core\ndef handle(r):\n    return _core.inits()\n"


def test_a_compiled_extension_file_is_initialised_once_and_shared(tmp_path, compiled):
    """Two spaces with one set, and a re-import after a release: one initialisation of
    the library, one module; the Python package around it is each version's own."""
    s = offline(tmp_path / "data", compiled)
    imported = []
    for n, space in enumerate(("o/a", "o/b", "o/a")):
        root = space_dir(tmp_path / str(n), {"main.py": USES_CTEST})
        (root / "requirements.txt").write_text("polyserve-ctest\n")
        installed = install(requirements.read(root, s), s)
        assert any(path.endswith(".so") for path in json.loads(
            (installed.site.parent / "set.json").read_text())["compiled"])  # fmt: skip
        imported.append(loader.import_version(space, n + 1, root, "main.py", deps=installed.site))
        if n == 1:
            loader.forget(imported[0].package)  # as an idle release does
    try:
        assert [i.module._core.inits() for i in imported] == [1, 1, 1]
        assert imported[0].module._core is imported[1].module._core is imported[2].module._core
        packages = [sys.modules[f"{i.package}.polyserve_ctest"] for i in imported[1:]]
        assert packages[0] is not packages[1]
    finally:
        for i in imported:
            loader.forget(i.package)


def test_an_extension_importing_its_own_package_by_name_is_a_422(inproc_compiled):
    c, _ = inproc_compiled
    r = deploy(
        c,
        "o/s",
        {"main.py": "import polyserve_cimport\n" + V1, "requirements.txt": "polyserve-cimport\n"},
    )
    assert r.status_code == 422 and "polyserve_cimport" in r.json()["error"], r.text
    assert c.get("/s/o/s/").text == "v1"


@pytest.fixture
def inproc_compiled(tmp_path, compiled) -> Iterator[tuple[TestClient, Path]]:
    data = tmp_path / "data"
    with TestClient(create_app(offline(data, compiled)), client=("127.0.0.1", 1)) as c:
        assert deploy(c, "o/s", {"main.py": V1}).status_code == 200
        yield c, data


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs: a real ENOSPC. Needs the right to mount (root, as in CI here)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_while_installing_is_a_507_and_changes_nothing(tmp_path, tiny_disk):
    wheels = tmp_path / "big-wheels"
    wheels.mkdir()
    wheel(wheels, "polyserve-big", "1.0", {"polyserve_big/blob.bin": os.urandom(6 << 20)})
    data = tiny_disk / "data"
    with TestClient(create_app(offline(data, wheels)), client=("127.0.0.1", 1)) as c:
        assert deploy(c, "o/s", {"main.py": V1}).status_code == 200
        r = deploy(c, "o/s", {"main.py": V1, "requirements.txt": "polyserve-big\n"})
        assert r.status_code == 507 and "disk is full" in r.json()["error"], r.text
        assert c.get("/s/o/s/").text == "v1"
        assert sorted(p.name for p in (data / "spaces/o/s/versions").iterdir()) == ["1", "1.json"]
        assert not list((data / "deps").glob("tmp/*")) and not list((data / "deps").glob("sets/*"))


def test_a_version_whose_set_is_gone_fails_to_load_saying_so(tmp_path):
    root = space_dir(tmp_path, {"main.py": V1})
    with pytest.raises(loader.LoadError, match="dependency set of o/s v3 is missing"):
        loader.import_version("o/s", 3, root, "main.py", deps=tmp_path / "no-such-set")
