"""polyserve's tests: a package, so pytest puts the repository root on sys.path, not tests/
(tenant code run in-process must not find tests/helpers.py as `import helpers`)."""
