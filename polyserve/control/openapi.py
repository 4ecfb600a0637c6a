"""The OpenAPI 3 description of the control plane, served at /_polyserve/openapi.json.

This module holds the paths: each route, its parameters and its answers; the bodies
those answers name live in polyserve/control/schemas.py.
"""

from __future__ import annotations

from typing import Any, get_args

from polyserve import __version__
from polyserve.control.schemas import SCHEMAS
from polyserve.names import PART
from polyserve.state.access import MAX_RATE
from polyserve.state.rollouts import MAX_STEP_S
from polyserve.state.secrets import NAME as SECRET_NAME
from polyserve.usage.answer import Only

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
_SECRET_PARAM = {
    "name": "secret",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": f"^{SECRET_NAME.pattern}$"},
}
_WRITE_ERRORS = {
    "401": _error("a token is required, or the one sent is not valid"),
    "403": _error("this client or token may not write this space"),
}
_FLEET_202 = (
    "a fleet: committed, but `hosts.lagging` have not applied it yet, or `hosts.skipped`"
    " cannot (each with its reason)"
)


def _space_write(summary: str, done: str) -> dict[str, Any]:
    """A write to one deployed space (Deploys.undeploy, Deploys.release): both answer alike."""
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
                                    "current": {
                                        "type": "string",
                                        "enum": ["true", "false"],
                                        "description": "false: store and validate it, leave"
                                        " the current version serving (for a rollout)",
                                    },
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "200": _json("published", {"$ref": "#/components/schemas/Deployed"}),
                    "202": _json(_FLEET_202, {"$ref": "#/components/schemas/Deployed"}),
                    **_WRITE_ERRORS,
                    "400": _error("the body is not a readable form"),
                    "413": _error(
                        "the upload or what it unpacks to is too large (in a fleet: for a live"
                        " host, named in `hosts`)"
                    ),
                    "422": _error("the space name or the module is not acceptable, and why"),
                    "424": _error("the package index did not answer for its dependencies"),
                    "507": _error(
                        "no room: the space table or the disk is full (in a fleet: a live"
                        " host's table, named in `hosts`)"
                    ),
                },
            }
        },
        "/_polyserve/spaces": {
            "get": {
                "summary": "Every deployed space and its current version",
                "responses": {
                    "200": _json(
                        "spaces",
                        {
                            "type": "object",
                            "required": ["spaces"],
                            "properties": {
                                "spaces": {
                                    "type": "object",
                                    "additionalProperties": {
                                        "$ref": "#/components/schemas/Current"
                                    },
                                }
                            },
                        },
                    )
                },
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
        "/_polyserve/spaces/{owner}/{name}/versions": {
            "get": {
                "summary": "The space's kept versions, which is current, and its history",
                "parameters": _SPACE_PARAMS,
                "responses": {
                    "200": _json("versions", {"$ref": "#/components/schemas/Versions"}),
                    "404": _error("the space was never deployed"),
                    "422": _error("the space name is not valid"),
                },
            }
        },
        "/_polyserve/spaces/{owner}/{name}/rollback": {
            "post": {
                "summary": "Make a kept version current again (default: the one the current"
                " version replaced); answers once no worker starts a request on another",
                "security": [{}, {"bearer": []}],
                "parameters": _SPACE_PARAMS,
                "requestBody": {
                    "required": False,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {"version": {"type": "integer", "minimum": 1}},
                            }
                        }
                    },
                },
                "responses": {
                    "200": _json("rolled back", {"$ref": "#/components/schemas/RolledBack"}),
                    "202": _json(_FLEET_202, {"$ref": "#/components/schemas/RolledBack"}),
                    **_WRITE_ERRORS,
                    "404": _error("the space is not deployed, or that version is not kept"),
                    "413": _error("the body is larger than a rollback's body can be"),
                    "422": _error("the space name or the body is not valid, and why"),
                },
            }
        },
        "/_polyserve/spaces/{owner}/{name}/rollout": {
            "get": {
                "summary": "The space's rollout: status, step, weights, each version's counts",
                "parameters": _SPACE_PARAMS,
                "responses": {
                    "200": _json("its rollout", {"$ref": "#/components/schemas/Rollout"}),
                    "404": _error("the space has no rollout"),
                },
            },
            "post": {
                "summary": "Start a rollout: plain requests move to a kept version by steps,"
                " rolled back by itself past the error-rate threshold (docs/rollouts.md)",
                "security": [{}, {"bearer": []}],
                "parameters": _SPACE_PARAMS,
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["version"],
                                "properties": {
                                    "version": {"type": "integer", "minimum": 1},
                                    "steps": {
                                        "type": "array",
                                        "minItems": 1,
                                        "maxItems": 100,
                                        "items": {"type": "integer", "minimum": 1, "maximum": 100},
                                        "description": "rising, ending with 100",
                                    },
                                    "step_s": {
                                        "type": "number",
                                        "exclusiveMinimum": True,
                                        "minimum": 0,
                                        "maximum": MAX_STEP_S,
                                    },
                                    "max_error_rate": {
                                        "type": "number",
                                        "minimum": 0,
                                        "maximum": 1,
                                    },
                                    "sticky_header": {
                                        "type": "string",
                                        "pattern": "^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$",
                                    },
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "200": _json("started", {"$ref": "#/components/schemas/Rollout"}),
                    "202": _json(_FLEET_202, {"$ref": "#/components/schemas/Rollout"}),
                    **_WRITE_ERRORS,
                    "404": _error("the space is not deployed, or that version is not kept"),
                    "409": _error("a rollout runs already, or that version is current"),
                    "422": _error("the body is not valid, and why"),
                },
            },
        },
        "/_polyserve/spaces/{owner}/{name}/rollout/{action}": {
            "post": {
                "summary": "Pause, resume or abort the space's rollout",
                "security": [{}, {"bearer": []}],
                "parameters": [
                    *_SPACE_PARAMS,
                    {
                        "name": "action",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string", "enum": ["pause", "resume", "abort"]},
                    },
                ],
                "responses": {
                    "200": _json("its rollout now", {"$ref": "#/components/schemas/Rollout"}),
                    "202": _json(_FLEET_202, {"$ref": "#/components/schemas/Rollout"}),
                    **_WRITE_ERRORS,
                    "404": _error("the space has no rollout, or no such action"),
                    "409": _error("the rollout is over"),
                },
            }
        },
        "/_polyserve/spaces/{owner}/{name}/secrets": {
            "get": {
                "summary": "A space's secrets: each name and when it was set, never a value",
                "description": "Reading them takes the right to deploy the space"
                " (docs/secrets.md).",
                "security": [{}, {"bearer": []}],
                "parameters": _SPACE_PARAMS,
                "responses": {
                    "200": _json("names", {"$ref": "#/components/schemas/Secrets"}),
                    **_WRITE_ERRORS,
                    "404": _error("the space is not deployed"),
                    "422": _error("the space name is not valid"),
                },
            }
        },
        "/_polyserve/spaces/{owner}/{name}/secrets/{secret}": {
            "put": {
                "summary": "Set a secret of a space (the body is its value); the space reloads",
                "description": "The space reads it with polyserve.secrets.get(NAME) from its"
                " next load on: once this answers 200, every worker (every live host) serves"
                " it with the new value. The answer never holds the value.",
                "security": [{}, {"bearer": []}],
                "parameters": [*_SPACE_PARAMS, _SECRET_PARAM],
                "requestBody": {
                    "required": True,
                    "content": {
                        # 64 KiB of UTF-8: at most 4 bytes a character
                        "text/plain": {"schema": {"type": "string", "maxLength": 16384}},
                    },
                },
                "responses": {
                    "200": _json("set", {"$ref": "#/components/schemas/SecretChanged"}),
                    "202": _json(_FLEET_202, {"$ref": "#/components/schemas/SecretChanged"}),
                    "400": _error("the secret's name is not valid, or its value is not UTF-8"),
                    **_WRITE_ERRORS,
                    "404": _error("the space is not deployed"),
                    "409": _error("the space has 100 secrets already: unset one first"),
                    "413": _error("the value is larger than 64 KiB"),
                    "422": _error("the space name is not valid"),
                },
            },
            "delete": {
                "summary": "Unset a secret of a space; the space reloads",
                "security": [{}, {"bearer": []}],
                "parameters": [*_SPACE_PARAMS, _SECRET_PARAM],
                "responses": {
                    "200": _json("unset", {"$ref": "#/components/schemas/SecretChanged"}),
                    "202": _json(_FLEET_202, {"$ref": "#/components/schemas/SecretChanged"}),
                    "400": _error("the secret's name is not valid"),
                    **_WRITE_ERRORS,
                    "404": _error("the space is not deployed, or has no secret by that name"),
                    "422": _error("the space name is not valid"),
                },
            },
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
        "/_polyserve/spaces/{owner}/{name}/keys": {
            "get": {
                "summary": "A space's access: private or not, and its keys' ids and rates"
                " (never a key, never a digest; docs/private-spaces.md)",
                "security": [{}, {"bearer": []}],
                "parameters": _SPACE_PARAMS,
                "responses": {
                    "200": _json("access", {"$ref": "#/components/schemas/Access"}),
                    **_WRITE_ERRORS,
                    "404": _error("the space is not deployed"),
                    "422": _error("the space name is not valid"),
                },
            },
            "post": {
                "summary": "Mint a key for the space: the key is in this answer only",
                "security": [{}, {"bearer": []}],
                "parameters": _SPACE_PARAMS,
                "requestBody": {
                    "required": False,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "rate": {
                                        "type": "number",
                                        "minimum": 0,
                                        "exclusiveMinimum": True,
                                        "maximum": MAX_RATE,
                                        "description": "requests per second, per worker",
                                    }
                                },
                            }
                        }
                    },
                },
                "responses": {
                    "200": _json("minted", {"$ref": "#/components/schemas/Minted"}),
                    "202": _json(_FLEET_202, {"$ref": "#/components/schemas/Minted"}),
                    **_WRITE_ERRORS,
                    "404": _error("the space is not deployed"),
                    "409": _error("the space has 8 keys already: revoke one first"),
                    "422": _error("the space name or the body is not valid, and why"),
                },
            },
        },
        "/_polyserve/spaces/{owner}/{name}/keys/{key_id}": {
            "delete": {
                "summary": "Revoke a key: once this answers 200, no worker takes it",
                "security": [{}, {"bearer": []}],
                "parameters": [
                    *_SPACE_PARAMS,
                    {
                        "name": "key_id",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string"},
                    },
                ],
                "responses": {
                    "200": _json("revoked", {"type": "object", "required": ["id", "revoked"]}),
                    "202": _json(_FLEET_202, {"type": "object", "required": ["id", "revoked"]}),
                    **_WRITE_ERRORS,
                    "404": _error("the space is not deployed, or has no such key"),
                },
            }
        },
        "/_polyserve/spaces/{owner}/{name}/access": {
            "put": {
                "summary": "Make a space private (only its keys pass) or public",
                "security": [{}, {"bearer": []}],
                "parameters": _SPACE_PARAMS,
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "additionalProperties": False,
                                "required": ["private"],
                                "properties": {"private": {"type": "boolean"}},
                            }
                        }
                    },
                },
                "responses": {
                    "200": _json("access", {"$ref": "#/components/schemas/Access"}),
                    "202": _json(_FLEET_202, {"$ref": "#/components/schemas/Access"}),
                    **_WRITE_ERRORS,
                    "404": _error("the space is not deployed"),
                    "422": _error("the space name or the body is not valid, and why"),
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
                        "schema": {"type": "string", "enum": list(get_args(Only))},
                    }
                ],
                "responses": {"200": _json("usage", {"$ref": "#/components/schemas/Usage"})},
            }
        },
        "/_polyserve/health": {
            "get": {
                "summary": "The answering worker and the versions it holds",
                "responses": {
                    "200": _json("health", {"type": "object", "required": ["pid"]}),
                    "503": _json(
                        "a fleet host not caught up with the fleet (`error` says why)",
                        {"type": "object", "required": ["pid", "error"]},
                    ),
                },
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
                    "307": {
                        "description": "in a fleet, a space of another pool than this"
                        " host's: Location is the same path on a live host of that pool",
                        "headers": {"Location": {"schema": {"type": "string"}}},
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/PoolRedirect"}
                            }
                        },
                    },
                    "401": _error(
                        "a private space: no `Authorization: Bearer <key>`, or not one of"
                        " its keys (docs/private-spaces.md); counted nowhere"
                    ),
                    "404": _error("the space is not deployed"),
                    "429": {
                        "description": "the key's rate is spent: retry after Retry-After s",
                        "headers": {"Retry-After": {"schema": {"type": "integer"}}},
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}
                        },
                    },
                    "503": {
                        "description": "in a fleet, a space of another pool that has no live"
                        " host (the demand is recorded, so one is started), or the fleet's"
                        " database is unreachable: retry after Retry-After seconds",
                        "headers": {"Retry-After": {"schema": {"type": "integer"}}},
                        "content": {
                            "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}
                        },
                    },
                },
            }
        },
    },
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": SCHEMAS,
    },
}
