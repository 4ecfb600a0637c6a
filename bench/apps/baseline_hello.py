"""Baseline B of 'dispatch overhead': the hello handler as a plain Starlette app."""

import importlib.util
from pathlib import Path

from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

_path = Path(__file__).resolve().parents[2] / "examples" / "hello" / "hello.py"
_spec = importlib.util.spec_from_file_location("hello", _path)
hello = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hello)


def endpoint(request):  # sync, like the space's handle: Starlette runs it in the threadpool
    return JSONResponse(hello.handle(request))


app = Starlette(routes=[Route("/", endpoint)])
