"""Helper module of the starlette-app example: `import words` finds this file."""


def load():
    return frozenset({"space", "model", "host", "deploy", "swap"})
