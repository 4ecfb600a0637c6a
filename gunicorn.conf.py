"""gunicorn configuration: polyserve.master.config's settings, read afresh at each start and HUP.

gunicorn reads every top-level name here as a setting, so helpers are underscored.
gunicorn executes this file again at each SIGHUP, and the call below reads the
environment again then; an import alone would not (Python imports a module once).
"""

from polyserve.master.config import gunicorn_settings as _gunicorn_settings

globals().update(_gunicorn_settings())
