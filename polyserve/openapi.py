"""The OpenAPI 3 description of the control plane, served at /_polyserve/openapi.json."""

from __future__ import annotations

from typing import Any

from polyserve import __version__
from polyserve.names import PART

NAME_PART = f"^{PART}$"
SPACE = f"^{PART}/{PART}$"


def _error(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_SPACE_PARAMS = [
    {
        "name": part,
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": NAME_PART},
    }
    for part in ("owner", "name")
]
_WRITE_ERRORS = {
    "401": _error("a token is required, or the one sent is not valid"),
    "403": _error("this client or token may not write this space"),
}


def _space_write(summary: str, done: str) -> dict[str, Any]:
    """A write to one deployed space (Host._change): delete and release answer alike."""
    return {
        "summary": summary,
        "security": [{}, {"bearer": []}],
        "parameters": _SPACE_PARAMS,
        "responses": {
            "200": _json(done, {"type": "object", "required": ["space", done]}),
            **_WRITE_ERRORS,
            "404": _error("the space is not deployed"),
            "422": _error("the space name is not valid"),
        },
    }


SPEC: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "polyserve control plane", "version": __version__},
    "paths": {
        "/_polyserve/deploy": {
            "post": {
                "summary": "Deploy a version of a space: a .py file or a tar (plain or gzip)",
                "security": [{}, {"bearer": []}],
                "requestBody": {
                    "required": True,
                    "content": {
                        "multipart/form-data": {
                            "schema": {
                                "type": "object",
                                "required": ["space", "module"],
                                "properties": {
                                    "space": {
                                        "type": "string",
                                        "pattern": SPACE,
                                        "description": "owner/name",
                                    },
                                    "module": {"type": "string", "format": "binary"},
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "200": _json("published", {"$ref": "#/components/schemas/Deployed"}),
                    **_WRITE_ERRORS,
                    "400": _error("the body is not a readable form"),
                    "413": _error("the upload or what it unpacks to is too large"),
                    "422": _error("the space name or the module is not acceptable, and why"),
                    "507": _error("no room: the space table or the disk is full"),
                },
            }
        },
        "/_polyserve/spaces": {
            "get": {
                "summary": "Every deployed space and its current version",
                "responses": {"200": _json("spaces", {"type": "object", "required": ["spaces"]})},
            }
        },
        "/_polyserve/spaces/{owner}/{name}": {
            "delete": _space_write("Undeploy a space", "deleted"),
        },
        "/_polyserve/spaces/{owner}/{name}/release": {
            "post": _space_write(
                "Release the space in every worker now; the next call imports it", "released"
            ),
        },
        "/_polyserve/spaces/{owner}/{name}/logs": {
            "get": {
                "summary": "A space's recent log records from every worker, oldest first",
                "description": "Reading them takes the right to deploy the space. Pass the"
                " answer's `next` as `since` to get only newer records (docs/logs.md).",
                "security": [{}, {"bearer": []}],
                "parameters": [
                    *_SPACE_PARAMS,
                    {
                        "name": "since",
                        "in": "query",
                        "required": False,
                        "description": "a cursor: the `next` of an earlier answer (default 0)",
                        "schema": {"type": "integer", "minimum": 0, "maximum": 10**18 - 1},
                    },
                ],
                "responses": {
                    "200": _json("records", {"$ref": "#/components/schemas/Logs"}),
                    **_WRITE_ERRORS,
                    "404": _error("the space is not deployed"),
                    "422": _error("the space name or `since` is not valid"),
                },
            }
        },
        "/_polyserve/": {
            "get": {
                "summary": "The dashboard: a self-contained page over this API",
                "responses": {
                    "200": {
                        "description": "the page",
                        "content": {"text/html": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/_polyserve/usage": {
            "get": {
                "summary": "Usage per space and for the host",
                "parameters": [
                    {
                        "name": "only",
                        "in": "query",
                        "required": False,
                        "description": "`host`: only the host section (the autoscaler's scrape)",
                        "schema": {"type": "string", "enum": ["host"]},
                    }
                ],
                "responses": {"200": _json("usage", {"$ref": "#/components/schemas/Usage"})},
            }
        },
        "/_polyserve/health": {
            "get": {
                "summary": "The answering worker and the versions it holds",
                "responses": {"200": _json("health", {"type": "object", "required": ["pid"]})},
            }
        },
        "/metrics": {
            "get": {
                "summary": "Usage in Prometheus text format",
                "responses": {
                    "200": {
                        "description": "metrics",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/s/{owner}/{name}/": {
            "get": {
                "summary": "Call a space (its own answers are the space's to define)",
                "parameters": _SPACE_PARAMS,
                "responses": {
                    "default": {"description": "the space's answer"},
                    "404": _error("the space is not deployed"),
                },
            }
        },
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "Error": {
                "type": "object",
                "required": ["error"],
                "properties": {"error": {"type": "string"}},
            },
            "Deployed": {
                "type": "object",
                "required": ["space", "version", "sha256", "size", "entry", "kind", "import_ms"],
                "properties": {
                    "space": {"type": "string"},
                    "version": {"type": "integer"},
                    "sha256": {"type": "string"},
                    "size": {"type": "integer"},
                    "entry": {"type": "string"},
                    "kind": {"enum": ["app", "handle"]},
                    "import_ms": {"type": "number"},
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
                            },
                        },
                    },
                    "host": {"type": "object"},
                },
            },
        },
    },
}
