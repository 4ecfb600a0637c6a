"""The onnx-tiny handler as a plain Starlette app: baseline B of 'model in-process', and
the separate model server of 'in-process vs a model server'."""

import importlib.util
from pathlib import Path

from starlette.applications import Starlette
from starlette.routing import Route

from polyserve.serve.answers import to_response

_path = Path(__file__).resolve().parents[2] / "examples" / "python-onnx-tiny" / "main.py"
_spec = importlib.util.spec_from_file_location("onnx_tiny", _path)
model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(model)


async def endpoint(request):
    return to_response(await model.handle(request))


app = Starlette(routes=[Route("/", endpoint, methods=["GET", "POST"])])
