"""polyserve: a pre-fork host that imports tenants' Python spaces in-process."""

__version__ = "0.1.0"
