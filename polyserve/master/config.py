"""gunicorn's configuration of a polyserve host: polyserve.settings' values, hooks.py's hooks.

gunicorn reads every top-level name of a configuration file as a setting, and executes
the file afresh at each start and each SIGHUP. Run as a file (`gunicorn -c
path/to/polyserve/master/config.py`, which is how `polyserve dev` starts a host from an
installed package), this module's top-level names are those settings; the repository's
gunicorn.conf.py calls `gunicorn_settings` instead. Not `-c python:polyserve.master.config`:
gunicorn imports a module once, so a HUP would not read the settings afresh.
"""

from __future__ import annotations

import os
from typing import Any

from polyserve import settings
from polyserve.master import hooks


def gunicorn_settings() -> dict[str, Any]:
    """gunicorn's settings, read from the environment now (settings.load)."""
    s = settings.load()
    return {
        "bind": s.bind,
        "workers": s.workers,
        # uvicorn-worker's UvicornWorker, with a shutdown that answers what it accepted:
        # see polyserve/http/worker.py.
        "worker_class": "polyserve.http.worker.Worker",
        "wsgi_app": "polyserve.app:app",
        "timeout": s.worker_timeout,
        # With setproctitle, ps shows "gunicorn: master [polyserve 127.0.0.1:8441]" and
        # "gunicorn: worker [polyserve …]": an operator tells this host from other gunicorns.
        "proc_name": f"polyserve {s.bind}",
        # gunicorn 27 binds a control socket under $HOME by default, where two hosts would
        # fight over one path; each host gets its own in its data directory instead.
        "control_socket": os.path.join(os.path.abspath(s.data_dir), "gunicorn.ctl"),
        "on_starting": hooks.on_starting,
        "when_ready": hooks.when_ready,
        "pre_fork": hooks.pre_fork,
        "post_fork": hooks.post_fork,
        "worker_exit": hooks.worker_exit,
        "child_exit": hooks.child_exit,
        "on_exit": hooks.on_exit,
    }


if __name__ != "polyserve.master.config":
    # Executed by gunicorn as its configuration file (a fresh module each time), not
    # imported: its top-level names are the settings.
    globals().update(gunicorn_settings())
