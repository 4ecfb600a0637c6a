"""The worker class under its old name, for gunicorn configurations that name it."""

from polyserve.http.worker import Worker

__all__ = ["Worker"]
