"""The request path in a worker: dispatch, the registry, the loader, deadlines, warm-up."""
