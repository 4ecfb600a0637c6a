"""The front of 'in-process vs a model server': forwards each request over a keep-alive
HTTP client to a separate model server (MODEL_SERVER_URL), as a model-server stack does."""

import contextlib
import os

import httpx2
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

MODEL_SERVER = os.environ["MODEL_SERVER_URL"]


@contextlib.asynccontextmanager
async def lifespan(app):
    limits = httpx2.Limits(max_keepalive_connections=64)
    async with httpx2.AsyncClient(base_url=MODEL_SERVER, limits=limits) as client:
        app.state.client = client
        yield


async def endpoint(request):
    upstream = await request.app.state.client.get("/")
    return Response(
        upstream.content, upstream.status_code, media_type=upstream.headers.get("content-type")
    )


app = Starlette(routes=[Route("/", endpoint)], lifespan=lifespan)
