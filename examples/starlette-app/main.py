"""A Starlette space: routes, url_for under the mount prefix, and a lifespan that loads state."""

import contextlib

import words  # shipped in this tar next to main.py; resolves to this space's own copy
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


@contextlib.asynccontextmanager
async def lifespan(app):
    # Loaded once per worker before the first request; handed to requests as state.
    yield {"vocabulary": words.load()}


async def index(request: Request):
    return JSONResponse(
        {
            "words": len(request.state.vocabulary),
            "lookup": str(request.url_for("lookup", word="space")),
        }
    )


async def lookup(request: Request):
    word = request.path_params["word"]
    return JSONResponse({"word": word, "known": word in request.state.vocabulary})


app = Starlette(
    routes=[Route("/", index), Route("/words/{word}", lookup, name="lookup")],
    lifespan=lifespan,
)
