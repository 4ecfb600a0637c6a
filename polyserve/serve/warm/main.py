"""A space of our own: each worker imports it once at boot, as spaces are imported, and
forgets it (polyserve.serve.warmup.in_worker)."""


def handle(request: object) -> dict[str, object]:
    return {}
