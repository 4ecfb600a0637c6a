"""gunicorn configuration: values from polyserve.settings, hooks from polyserve.master.hooks.

gunicorn reads every top-level name here as a setting, so helpers are underscored.
"""

import os as _os

from polyserve import settings as _settings
from polyserve.master import hooks as _hooks

_s = _settings.load()

bind = _s.bind
workers = _s.workers
# uvicorn-worker's UvicornWorker, with a shutdown that answers what it accepted:
# see polyserve/http/worker.py.
worker_class = "polyserve.http.worker.Worker"
wsgi_app = "polyserve.app:app"
timeout = _s.worker_timeout
# With setproctitle, ps shows "gunicorn: master [polyserve 127.0.0.1:8441]" and
# "gunicorn: worker [polyserve …]": an operator tells this host from other gunicorns.
proc_name = f"polyserve {_s.bind}"
# gunicorn 27 binds a control socket under $HOME by default, where two hosts would fight
# over one path; each host gets its own in its data directory instead.
control_socket = _os.path.join(_os.path.abspath(_s.data_dir), "gunicorn.ctl")

on_starting = _hooks.on_starting
when_ready = _hooks.when_ready
pre_fork = _hooks.pre_fork
post_fork = _hooks.post_fork
worker_exit = _hooks.worker_exit
child_exit = _hooks.child_exit
on_exit = _hooks.on_exit
