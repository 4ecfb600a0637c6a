"""polyserve's worker with uvicorn's own httptools protocol instead of polyserve/http/strict.py:
the baseline of the "strict HTTP" scenario (GUNICORN_CMD_ARGS="-k plain_worker.PlainWorker")."""

from __future__ import annotations

from typing import Any

from polyserve.http.worker import Worker


class PlainWorker(Worker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.config.http = "httptools"
