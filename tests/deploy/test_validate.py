"""Unit tests of polyserve.deploy.validate: a throwaway subprocess imports a version before publish,
each one both spawned as a new interpreter and forked from the fork server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from polyserve.deploy.validate import validate
from polyserve.errors import ClientError
from tests.helpers import running_forkserver


@pytest.fixture(scope="module")
def forkserver() -> Iterator[str]:
    """One fork server for the module's forked validations."""
    with running_forkserver() as server:
        yield server.name


@pytest.fixture(params=["spawned", "forked"])
def via(request: pytest.FixtureRequest) -> str | None:
    """Each test runs with a new interpreter per validation, and through the fork server."""
    return request.getfixturevalue("forkserver") if request.param == "forked" else None


def check(
    tmp_path: Path,
    via: str | None,
    source: str,
    timeout: float = 20,
    memory_mb: int = 4096,
    files: dict[str, str] | None = None,
) -> dict[str, object]:
    (tmp_path / "main.py").write_text(source)
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(text)
    return asyncio.run(validate(tmp_path, "main.py", timeout, memory_mb, forkserver=via))


def test_a_good_module_reports_kind_and_import_time_and_leaves_bytecode(tmp_path, via):
    result = check(
        tmp_path,
        via,
        "print('noise on stdout')\ndef handle(r): return 1\n",
        files={"helpers.py": "X = 1\n"},
    )
    assert result["kind"] == "handle"
    assert isinstance(result["import_ms"], float) and result["import_ms"] >= 0
    cached = sorted(p.name.split(".")[0] for p in (tmp_path / "__pycache__").iterdir())
    assert cached == ["helpers", "main"]


@pytest.mark.parametrize(
    "source,message",
    [
        ("def handle(r):\n  return (\n", "main.py, line 2: SyntaxError"),
        ("x = 1\n\n1 / 0\n", "main.py, line 3: ZeroDivisionError: division by zero"),
        ("VALUE = 1\n", "neither `app`"),
        # Imports run on a worker thread, as in a worker: main-thread-only code fails.
        (
            "import asyncio\nLOOP = asyncio.get_event_loop()\ndef handle(r): return 1\n",
            "main.py, line 2: RuntimeError",
        ),
        (
            "import signal\nsignal.signal(signal.SIGUSR1, signal.SIG_IGN)\n"
            "def handle(r): return 1\n",
            "main.py, line 2: ValueError",
        ),
        # The lifespan startup runs too.
        (
            "import contextlib\nfrom starlette.applications import Starlette\n"
            "@contextlib.asynccontextmanager\nasync def lifespan(app):\n"
            "    raise RuntimeError('no weights')\n    yield\n"
            "app = Starlette(lifespan=lifespan)\n",
            "(?s)startup failed.*no weights",
        ),
    ],
)
def test_a_bad_module_says_what_to_fix(tmp_path, via, source, message):
    with pytest.raises(ClientError, match=message) as err:
        check(tmp_path, via, source)
    assert err.value.status == 422


def test_a_hanging_import_is_killed_at_the_timeout(tmp_path, via):
    with pytest.raises(ClientError, match="within 1 s"):
        check(tmp_path, via, "import time\ntime.sleep(60)\n", timeout=1)


@pytest.mark.parametrize(
    "source,how",
    [
        ("import os\nos._exit(7)\n", "exit code 7"),
        ("import ctypes\nctypes.string_at(0)\n", "signal SIGSEGV"),
    ],
)
def test_an_import_that_ends_the_process_is_refused(tmp_path, via, source, how):
    with pytest.raises(ClientError, match=how):
        check(tmp_path, via, source)


def test_an_unbounded_allocation_hits_the_address_space_limit(tmp_path, via):
    with pytest.raises(ClientError, match="address-space limit"):
        check(tmp_path, via, "blob = bytearray(2 << 30)\n", memory_mb=512)


def test_stderr_of_the_import_is_returned(tmp_path, via):
    with pytest.raises(ClientError) as err:
        check(
            tmp_path,
            via,
            "import sys\nsys.stderr.write('model.onnx not found')\nraise SystemExit(1)\n",
        )
    assert "model.onnx not found" in err.value.details["stderr"]


def test_only_the_tail_of_the_imports_output_is_kept(tmp_path, via):
    """An import that writes 8 MiB to stderr gets back a `stderr` of at most a few KiB:
    the end of what it wrote."""
    with pytest.raises(ClientError) as err:
        check(
            tmp_path,
            via,
            "import sys\nfor _ in range(8):\n    sys.stderr.write('x' * (1 << 20))\n"
            "sys.stderr.write('last words')\nraise SystemExit(1)\n",
        )
    stderr = err.value.details["stderr"]
    assert len(stderr) <= 4096 and stderr.endswith("last words")
