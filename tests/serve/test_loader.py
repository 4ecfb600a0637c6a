"""Unit tests of polyserve.serve.loader, namespace and answers: fresh namespaces, versions,
handle(), lifespan."""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import threading
import weakref
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.responses import JSONResponse
from starlette.testclient import TestClient

from polyserve.serve import answers, loader


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def load(tmp_path: Path, files: dict[str, str], space: str = "o/s", entry: str = "main.py"):
    root = write(tmp_path / space.replace("/", "_") / "v", files)
    return loader.import_version(space, 1, root, entry)


HELPERS_USER = """
import helpers
from . import helpers as relative
from helpers import WHO as WHO_FROM
import pkg.inner

def handle(request):
    import helpers as lazy  # resolved at call time, through this module's builtins
    return {"top": helpers.WHO, "relative": relative.WHO, "lazy": lazy.WHO,
            "from": WHO_FROM, "pkg": pkg.inner.WHO}
"""


def test_two_spaces_each_see_their_own_helpers(tmp_path):
    spaces = {}
    for who in ("alice", "bob"):
        spaces[who] = load(
            tmp_path,
            {
                "main.py": HELPERS_USER,
                "helpers.py": f"WHO = {who!r}\n",
                "pkg/__init__.py": "",
                "pkg/inner.py": f"WHO = {who + '-pkg'!r}\n",
            },
            space=f"{who}/s",
        )
    assert "helpers" not in sys.modules
    for who, imported in spaces.items():
        result = imported.module.handle(None)
        assert result == {
            "top": who,
            "relative": who,
            "lazy": who,
            "from": who,
            "pkg": who + "-pkg",
        }
        loader.forget(imported.package)


def test_each_import_gets_a_fresh_module_name(tmp_path):
    a = load(tmp_path, {"main.py": "def handle(r): return 1\n"})
    b = loader.import_version("o/s", 1, Path(a.module.__file__).parent, "main.py")
    assert a.package != b.package and a.module is not b.module
    assert a.package.startswith("_ps_o__s__v1_")
    loader.forget(a.package)
    loader.forget(b.package)


def test_stdlib_and_installed_packages_import_as_usual(tmp_path):
    imported = load(
        tmp_path,
        {
            "main.py": "import json, starlette\n"
            "def handle(r):\n    import base64\n"
            "    return json.dumps([base64.__name__])\n"
        },
    )
    assert imported.module.handle(None) == '["base64"]'
    loader.forget(imported.package)


def test_kind_is_app_when_both_are_exported(tmp_path):
    imported = load(tmp_path, {"main.py": "async def app(s, r, w): pass\ndef handle(r): pass\n"})
    assert imported.kind == "app"
    loader.forget(imported.package)


@pytest.mark.parametrize(
    "source,message,line",
    [
        ("x = 1\n", "neither `app`", None),
        ("app = 3\n", "`app` must be an ASGI or WSGI application", None),
        ("def handle(r):\n    return (\n", "SyntaxError", 2),
        ("import helpers\n", "ModuleNotFoundError: No module named 'helpers'", 1),
        ("\n\nraise RuntimeError('no model file')\n", "RuntimeError: no model file", 3),
        ("import sys\nsys.exit(3)\n", "SystemExit: 3", 2),
    ],
)
def test_a_bad_module_is_a_load_error_that_says_where(tmp_path, source, message, line):
    before = set(sys.modules)  # other tests' versions may still be loaded
    with pytest.raises(loader.LoadError, match=message) as err:
        load(tmp_path, {"main.py": source})
    if line is not None:
        assert err.value.details["file"] == "main.py"
        assert err.value.details["line"] == line
        assert f"main.py, line {line}" in err.value.details["error"]
    assert not [n for n in set(sys.modules) - before if n.startswith("_ps_o__s__")]


def test_a_forgotten_version_is_collected(tmp_path):
    before = set(sys.modules)  # other tests' versions may still be loaded
    imported = load(
        tmp_path,
        {
            "main.py": "import helpers\ndef handle(r): return helpers\n",
            "helpers.py": "BIG = bytearray(1 << 20)\n",
        },
    )
    module = weakref.ref(imported.module)
    helpers = weakref.ref(imported.module.handle(None))
    loader.forget(imported.package)
    del imported
    gc.collect()
    assert module() is None and helpers() is None
    assert not [n for n in set(sys.modules) - before if n.startswith("_ps_o__s__")]


# -- handle() ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "result,status,body,ctype",
    [
        ({"a": 1}, 200, b'{"a":1}', "application/json"),
        ([1, 2], 200, b"[1,2]", "application/json"),
        ("hi", 200, b"hi", "text/plain; charset=utf-8"),
        (b"\x00\x01", 200, b"\x00\x01", "application/octet-stream"),
        (None, 204, b"", None),
        (3.5, 500, None, "application/json"),
    ],
)
def test_handle_results_become_responses(result, status, body, ctype):
    client = TestClient(answers.HandleApp(lambda request: result))
    response = client.get("/")
    assert response.status_code == status
    assert response.headers.get("content-type") == ctype
    if body is not None:
        assert response.content == body
    else:
        assert "return a Response, dict, list, str, bytes or None" in response.json()["error"]


def test_a_response_is_passed_through():
    from starlette.responses import PlainTextResponse

    client = TestClient(answers.HandleApp(lambda r: PlainTextResponse("t", status_code=201)))
    response = client.get("/")
    assert (response.status_code, response.text) == (201, "t")


def test_sync_handle_runs_in_the_threadpool_and_async_handle_inline():
    seen = {}

    def sync_handle(request):
        seen["sync"] = threading.get_ident()

    async def async_handle(request):
        seen["async"] = threading.get_ident()
        seen["loop"] = id(asyncio.get_running_loop())

    assert not answers.HandleApp(sync_handle).is_async
    assert answers.HandleApp(async_handle).is_async

    async def main():
        seen["loop_thread"] = threading.get_ident()
        for handle in (sync_handle, async_handle):
            app = answers.HandleApp(handle)
            sent: list[dict] = []
            scope = {
                "type": "http",
                "method": "GET",
                "path": "/",
                "headers": [],
                "query_string": b"",
            }

            async def receive():
                return {"type": "http.request", "body": b""}

            async def send(message, sent=sent):
                sent.append(message)

            await app(scope, receive, send)
            assert sent[0]["status"] == 204

    asyncio.run(main())
    assert seen["async"] == seen["loop_thread"]
    assert seen["sync"] != seen["loop_thread"]


# -- lifespan ----------------------------------------------------------------------------

LIFESPAN_APP = """
import contextlib
from starlette.applications import Starlette
EVENTS = []

@contextlib.asynccontextmanager
async def lifespan(app):
    EVENTS.append("startup")
    yield {"ready": True}
    EVENTS.append("shutdown")

app = Starlette(lifespan=lifespan)
"""


def test_lifespan_startup_gives_state_and_stop_runs_shutdown(tmp_path):
    imported = load(tmp_path, {"main.py": LIFESPAN_APP})
    events = imported.module.EVENTS

    async def main():
        await loader.start(imported, timeout=5)
        assert events == ["startup"] and imported.state == {"ready": True}
        await loader.stop(imported, timeout=5)

    asyncio.run(main())
    assert events == ["startup", "shutdown"]
    assert imported.package not in sys.modules


def test_an_app_without_lifespan_support_still_starts(tmp_path):
    imported = load(
        tmp_path,
        {"main.py": "async def app(scope, receive, send):\n    assert scope['type'] == 'http'\n"},
    )
    asyncio.run(loader.start(imported, timeout=5))
    assert imported.lifespan is None
    loader.forget(imported.package)


def test_a_failing_startup_is_a_load_error(tmp_path):
    imported = load(
        tmp_path,
        {
            "main.py": LIFESPAN_APP.replace(
                'EVENTS.append("startup")', 'raise RuntimeError("model missing")'
            )
        },
    )
    with pytest.raises(loader.LoadError, match="startup failed"):
        asyncio.run(loader.start(imported, timeout=5))
    assert imported.package not in sys.modules


HANGING_STARTUP = """
import asyncio

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        await receive()
        await asyncio.Event().wait()  # never answers lifespan.startup
"""


def test_a_startup_that_hangs_is_a_load_error_that_leaves_no_task_behind(tmp_path):
    """A lifespan startup that never answers is a LoadError at the timeout, and leaves no
    task running the app's lifespan in the loop, and no module of the version."""
    imported = load(tmp_path, {"main.py": HANGING_STARTUP})

    async def main():
        with pytest.raises(loader.LoadError, match=r"longer than 0\.5 s"):
            await loader.start(imported, timeout=0.5)
        me = asyncio.current_task()
        for _ in range(200):  # a cancelled task ends within a few loop iterations
            if asyncio.all_tasks() == {me}:
                break
            await asyncio.sleep(0.01)
        return asyncio.all_tasks() - {me}

    assert asyncio.run(main()) == set()
    assert imported.package not in sys.modules


# -- handle()'s JSON answers (orjson) ---------------------------------------------------


def _json_values(scalars: st.SearchStrategy) -> st.SearchStrategy:
    tree = st.recursive(
        scalars,
        lambda children: st.lists(children) | st.dictionaries(st.text(), children),
        max_leaves=20,
    )
    return st.lists(tree) | st.dictionaries(st.text(), tree)


_NO_FLOATS = (
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.text()
)


@given(_json_values(_NO_FLOATS))
def test_a_dict_or_list_answer_is_byte_for_byte_what_the_stdlib_would_send(value):
    assert answers.to_response(value).body == JSONResponse(value).body


@given(_json_values(_NO_FLOATS | st.floats(allow_nan=False, allow_infinity=False)))
def test_floats_keep_their_values(value):
    """Only their spelling may differ: orjson writes 0.00006103515625 for 6.103515625e-05."""
    assert json.loads(answers.to_response(value).body) == json.loads(JSONResponse(value).body)


def test_numpy_values_and_big_ints_encode_and_unencodable_values_still_fail():
    model_output = {"y": np.arange(3), "p": np.float32(0.5)}
    assert answers.to_response(model_output).body == b'{"y":[0,1,2],"p":0.5}'
    big = answers.to_response({"big": 2**70}).body  # past orjson's 64 bits: the stdlib's
    assert big == b'{"big":1180591620717411303424}'
    with pytest.raises(TypeError):
        answers.to_response({"s": {1, 2}})  # dispatch turns it into a JSON 500
