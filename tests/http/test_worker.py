"""polyserve.http.worker.Worker._serve is a copy of uvicorn-worker's private UvicornWorker._serve
with two changes; these tests fail when upstream's method is no longer what was copied."""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import textwrap

from uvicorn_worker import UvicornWorker

from polyserve.http.worker import Worker

# UvicornWorker._serve as uvicorn-worker 0.2.0, 0.3.0 and 0.4.0 write it (the same in
# each; pyproject.toml allows those releases only).
UPSTREAM_SERVE = """
async def _serve(self) -> None:
    self.config.app = self.wsgi
    server = Server(config=self.config)
    self._install_sigquit_handler()
    await server.serve(sockets=self.sockets)
    if not server.started:
        sys.exit(Arbiter.WORKER_BOOT_ERROR)
"""

RECHECK = (
    "polyserve/http/worker.py's Worker._serve mirrors UvicornWorker._serve of uvicorn-worker"
    " 0.2 to 0.4; uvicorn-worker {version} differs: re-check Worker._serve against it, then"
    " update UPSTREAM_SERVE here and the uvicorn-worker bound in pyproject.toml."
)


def tree(source: str) -> ast.FunctionDef | ast.AsyncFunctionDef:
    """The function `source` defines, without comments, docstring or layout."""
    (function,) = ast.parse(textwrap.dedent(source)).body
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        function.body = body[1:]
    return function


def recheck() -> str:
    return RECHECK.format(version=importlib.metadata.version("uvicorn-worker"))


def test_upstream_serve_is_what_worker_py_copied():
    upstream = inspect.getsource(UvicornWorker._serve)
    assert ast.dump(tree(upstream)) == ast.dump(tree(UPSTREAM_SERVE)), (
        f"{recheck()}\nIts _serve is now:\n{upstream}"
    )


def test_upstream_run_still_calls_serve():
    """Worker overrides _serve only: upstream's run() must still be what calls it."""
    assert "self._serve()" in inspect.getsource(UvicornWorker.run), recheck()


class _AsUpstream(ast.NodeTransformer):
    """Undo Worker._serve's two changes: it applies FORWARDED_ALLOW_IPS to the app, and
    serves with polyserve's _Server (whose shutdown answers what it accepted)."""

    def visit_Expr(self, node: ast.Expr) -> ast.Expr | None:
        func = getattr(node.value, "func", None)
        return None if getattr(func, "attr", None) == "trust_forwarded" else node

    def visit_Name(self, node: ast.Name) -> ast.Name:
        return ast.Name(id="Server", ctx=node.ctx) if node.id == "_Server" else node


def test_worker_serve_is_the_upstream_one_with_its_two_changes():
    ours = _AsUpstream().visit(tree(inspect.getsource(Worker._serve)))
    assert ast.dump(ours) == ast.dump(tree(UPSTREAM_SERVE)), (
        "Worker._serve differs from UPSTREAM_SERVE by more than its trust_forwarded call"
        " and its _Server: keep the two in step (see polyserve/http/worker.py)."
    )
