"""The OpenAPI components of the control plane: the schemas of the bodies its routes answer with."""

from __future__ import annotations

from typing import Any

from polyserve.names import POOL

POOL_NAME = {
    "type": "string",
    "pattern": f"^{POOL}$",
    "description": "the pool whose hosts run it (polyserve.toml's `pool`; default cpu)",
}
# A space's kind, as a deploy's answer and a version's metadata name it.
KIND = {"enum": ["app", "wsgi", "handle"]}
# A fleet write's answer says which hosts applied it.
HOSTS = {"type": "object", "description": "in a fleet: applied, live; lagging and skipped (a 202)"}


def _array_of(schema: str) -> dict[str, Any]:
    return {"type": "array", "items": {"$ref": f"#/components/schemas/{schema}"}}


SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "string"}},
    },
    "Access": {
        "type": "object",
        "required": ["space", "private", "keys"],
        "properties": {
            "space": {"type": "string"},
            "private": {"type": "boolean"},
            "keys": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["id"],
                    "properties": {
                        "id": {"type": "string"},
                        "rate": {"type": ["number", "null"]},
                        "created": {"type": "number"},
                    },
                },
            },
        },
    },
    "Minted": {
        "type": "object",
        "required": ["space", "id", "key"],
        "properties": {
            "space": {"type": "string"},
            "id": {"type": "string"},
            "key": {"type": "string", "description": "shown this once: only its digest is kept"},
            "rate": {"type": ["number", "null"]},
            "private": {"type": "boolean"},
        },
    },
    "Deployed": {
        "type": "object",
        "required": [
            "space",
            "version",
            "sha256",
            "size",
            "entry",
            "pool",
            "kind",
            "import_ms",
        ],
        "properties": {
            "space": {"type": "string"},
            "version": {"type": "integer"},
            "sha256": {"type": "string"},
            "size": {"type": "integer"},
            "entry": {"type": "string"},
            "pool": POOL_NAME,
            "kind": KIND,
            "import_ms": {"type": "number"},
            "dependencies": {
                "type": "object",
                "description": "a tar's requirements.txt or polyserve.toml"
                " dependencies: the installed set (docs/dependencies.md)",
            },
        },
    },
    "Current": {
        "type": "object",
        "description": "a space's current version, as its deploy published it",
        "required": ["version", "entry", "pool"],
        "properties": {
            "version": {"type": "integer"},
            "entry": {"type": "string"},
            "pool": POOL_NAME,
        },
    },
    "PoolRedirect": {
        "type": "object",
        "required": ["space", "pool", "location", "message"],
        "properties": {
            "space": {"type": "string"},
            "pool": POOL_NAME,
            "location": {"type": "string"},
            "message": {"type": "string"},
        },
    },
    "Version": {
        "type": "object",
        "required": ["version", "sha256", "size", "entry", "kind", "current"],
        "properties": {
            "version": {"type": "integer"},
            "sha256": {"type": "string"},
            "size": {"type": "integer"},
            "entry": {"type": "string"},
            "kind": KIND,
            "import_ms": {"type": "number"},
            "deployed_at": {"type": "number", "description": "unix seconds"},
            "replaced": {
                "type": "integer",
                "nullable": True,
                "description": "the version current when this one was deployed",
            },
            "current": {"type": "boolean"},
        },
    },
    "Event": {
        "type": "object",
        "required": ["event", "version", "previous", "at"],
        "properties": {
            "event": {"enum": ["deploy", "rollback", "delete", "release"]},
            "version": {"type": "integer", "nullable": True},
            "previous": {"type": "integer", "nullable": True},
            "at": {"type": "number", "description": "unix seconds"},
        },
    },
    "Versions": {
        "type": "object",
        "required": ["space", "current", "store", "versions", "history"],
        "properties": {
            "space": {"type": "string"},
            "current": {"type": "integer", "nullable": True},
            "store": {"enum": ["host", "fleet"]},
            "keep_versions": {"type": "integer"},
            "versions": _array_of("Version"),
            "history": _array_of("Event"),
        },
    },
    "RolledBack": {
        "type": "object",
        "required": ["space", "version", "previous", "sha256", "entry", "kind"],
        "properties": {
            "space": {"type": "string"},
            "version": {"type": "integer"},
            "previous": {"type": "integer"},
            "sha256": {"type": "string"},
            "size": {"type": "integer"},
            "entry": {"type": "string"},
            "kind": KIND,
            "import_ms": {"type": "number"},
            "hosts": HOSTS,
        },
    },
    "Rollout": {
        "type": "object",
        "required": ["space", "version", "old", "status", "step", "weights", "versions"],
        "properties": {
            "space": {"type": "string"},
            "version": {"type": "integer", "description": "the new version"},
            "old": {"type": "integer", "description": "the version current at its start"},
            "status": {"enum": ["running", "paused", "rolled_back", "completed", "aborted"]},
            "reason": {"type": "string", "nullable": True, "description": "why it ended"},
            "step": {"type": "integer", "description": "index into steps"},
            "steps": {"type": "array", "items": {"type": "integer"}},
            "step_s": {"type": "number"},
            "max_error_rate": {"type": "number"},
            "sticky_header": {"type": "string", "nullable": True},
            "weight": {"type": "integer", "description": "the new version's percent now"},
            "weights": {"type": "object", "description": "percent by version number"},
            "versions": {
                "type": "object",
                "description": "requests and errors by version number, over the rollout"
                " (in a fleet, every host's)",
            },
            "warning": {
                "type": "string",
                "description": "in a fleet: the database is unreachable, so the step under"
                " way counts this host's requests only",
            },
            "history": {"type": "array", "items": {"type": "object"}},
            "hosts": HOSTS,  # a write's answer
            "started_at": {"type": "number", "description": "Unix seconds"},
            "step_started_at": {"type": "number", "description": "Unix seconds"},
            "ended_at": {"type": "number", "nullable": True},
        },
    },
    "Secrets": {
        "type": "object",
        "required": ["space", "secrets"],
        "properties": {
            "space": {"type": "string"},
            "secrets": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name", "updated_at"],
                    "properties": {
                        "name": {"type": "string"},
                        "updated_at": {"type": "number", "description": "Unix seconds"},
                    },
                },
            },
        },
    },
    "SecretChanged": {
        "type": "object",
        "required": ["space", "secret"],
        "properties": {
            "space": {"type": "string"},
            "secret": {"type": "string", "description": "its name (never its value)"},
            "set": {"type": "boolean"},
            "unset": {"type": "boolean"},
            "workers_signalled": {"type": "integer"},
            "hosts": HOSTS,
        },
    },
    "Logs": {
        "type": "object",
        "required": ["records", "next"],
        "properties": {
            "records": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": [
                        "seq",
                        "time",
                        "level",
                        "version",
                        "worker",
                        "stream",
                        "message",
                    ],
                    "properties": {
                        "seq": {"type": "integer", "description": "its cursor"},
                        "time": {"type": "number", "description": "Unix seconds"},
                        "level": {"type": "string"},
                        "version": {"type": "integer"},
                        "worker": {"type": "integer", "description": "the pid"},
                        "stream": {"enum": ["logging", "stdout", "stderr"]},
                        "message": {"type": "string"},
                    },
                },
            },
            "next": {"type": "integer", "description": "pass back as `since`"},
        },
    },
    "Usage": {
        "type": "object",
        "required": ["host"],  # `spaces` too, but with ?only=host
        "properties": {
            "spaces": {
                "type": "object",
                "additionalProperties": {
                    "type": "object",
                    "required": ["requests", "busy_ms", "warm_s", "loaded"],
                    "properties": {
                        "requests": {"type": "integer"},
                        "busy_ms": {"type": "integer"},
                        "warm_s": {"type": "integer"},
                        "loaded": {"type": "boolean"},
                        "memory_kib": {
                            "type": "integer",
                            "description": "anonymous memory (RssAnon) the latest"
                            " load added to its worker",
                        },
                        "mapped_kib": {
                            "type": "integer",
                            "description": "the space's own files mapped by the"
                            " host's workers (model weights through"
                            " polyserve.models), each range counted once per host",
                        },
                        "batches": {
                            "type": "integer",
                            "description": "batched runs made (docs/batching.md)",
                        },
                        "batch_rows": {
                            "type": "integer",
                            "description": "rows those runs computed, all batches together",
                        },
                        **{
                            f"p{q}_ms": {
                                "type": "number",
                                "nullable": True,
                                "description": f"the {q}th percentile of the request"
                                " durations over the host section's latency_window_s"
                                " (about the last minute), interpolated inside its"
                                " histogram bucket; null with no request in it",
                            }
                            for q in (50, 99)
                        },
                        "gpu_memory_kib": {
                            "type": "integer",
                            "description": "a GPU host's only: device memory the latest"
                            " load added to its worker (NVML; docs/gpu.md)",
                        },
                        "recycled": {
                            "type": "integer",
                            "description": "a GPU host's only: releases whose device"
                            " memory stayed, so the worker was recycled",
                        },
                        **{
                            f"released_{reason}": {"type": "integer", "description": doc}
                            for reason, doc in (
                                ("idle", "releases after POLYSERVE_IDLE_TTL idle"),
                                ("memory", "releases under POLYSERVE_WORKER_MEMORY_MB"),
                                ("demand", "releases on demand, one per worker"),
                            )
                        },
                    },
                },
            },
            "host": {
                "type": "object",
                "properties": {
                    "latency_window_s": {
                        "type": "number",
                        "description": "the seconds p50_ms and p99_ms span: 60 to 65"
                        " (less in a worker younger than that); the full answer's",
                    },
                },
            },
        },
    },
}
