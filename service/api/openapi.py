"""The OpenAPI document: FastAPI's own routes plus the plain ASGI ones of `ingest.py`, `reads.py` and `sync.py`."""

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from service.api.reads import MANY_ROUTE, MAX_IDS, ONE_ROUTE
from service.api.sync import SYNC_ROUTE
from service.progress.content import CONTENT_KINDS, MAX_ID
from service.progress.sync import SYNC_MAX_ITEMS, SyncRequest


def _error_response(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


def _too_many(description: str) -> dict[str, Any]:
    return {
        **_error_response(description),
        "headers": {
            "Retry-After": {
                "description": "Whole seconds after which a request is accepted again.",
                "schema": {"type": "integer", "minimum": 1},
            }
        },
    }


def _retry_soon(description: str) -> dict[str, Any]:
    return {
        **_error_response(description),
        "headers": {"Retry-After": {"description": "Seconds to wait: 1.", "schema": {"type": "integer", "minimum": 1}}},
    }


_UNAUTHENTICATED = _error_response(
    "Missing, malformed, expired or wrongly signed token; or the identity header (Authorization, or the "
    "gateway's in gateway mode) twice."
)
_BODY_TIMEOUT = _error_response("Body not received within BODY_READ_TIMEOUT_SECONDS; the connection is closed.")


def _progress_operation(name: str, body_schema: str) -> dict[str, Any]:
    return {
        "post": {
            "operationId": f"post_{name}_progress",
            "summary": f"Record a progress heartbeat ({name})",
            "security": [{"bearerAuth": []}],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{body_schema}"}}},
            },
            "responses": {
                "201": {
                    "description": "Stored; persisted to Postgres by the next flush.",
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Created"}}},
                },
                "400": _error_response("Malformed JSON."),
                "401": _UNAUTHENTICATED,
                "404": _error_response("The content id does not exist (`unknown <field> <id>`); nothing written."),
                "408": _BODY_TIMEOUT,
                "413": _error_response("Body larger than MAX_BODY_BYTES."),
                "422": _error_response("Valid JSON, invalid fields; `detail` names each one."),
                "429": _too_many("Too many heartbeats from this user (far above the app's rhythm)."),
                "503": _error_response("No store can take the heartbeat now; retry later."),
            },
        }
    }


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json_content(schema_name: str, example: object) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(schema_name), "example": example}}


_PROGRESS_EXAMPLE = {
    "content_type": "lesson", "content_id": 42, "position": 318.5,
    "updated_at": "2026-11-30T09:27:51.123000+00:00", "completed_at": None,
}  # fmt: skip
_CONTENT_TYPE_PARAMETER = {
    "name": "content_type", "in": "path", "required": True,
    "schema": {"type": "string", "enum": [kind.name for kind in CONTENT_KINDS]},
}  # fmt: skip
_READ_ERRORS = {
    "401": _UNAUTHENTICATED,
    "422": _error_response("Unknown content type or ids that are not integers from 1 to 2^63-1; `detail` says which."),
    "429": _too_many("Too many requests from this user (they count against the heartbeats' per-user rate)."),
    "503": _retry_soon(
        "Redis or Postgres cannot be read now, or answers too slowly for the reads waiting (or no database is"
        " configured); retry later."
    ),
}


def _read_operations() -> dict[str, Any]:
    one = {
        "get": {
            "operationId": "get_progress",
            "summary": "The token's user's progress on one content, at its freshest",
            "description": "The buffered heartbeat when it is newer than the row in Postgres, else the row; "
            "`completed_at` as the next flush will set it. No lag behind the flush.",
            "security": [{"bearerAuth": []}],
            "parameters": [
                _CONTENT_TYPE_PARAMETER,
                {
                    "name": "content_id",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_ID},
                },
            ],
            "responses": {
                "200": {
                    "description": "The freshest position.",
                    "content": _json_content("Progress", _PROGRESS_EXAMPLE),
                },
                "404": _error_response("No progress of this user on this content (or no such content)."),
                **_READ_ERRORS,
            },
        }
    }
    many = {
        "get": {
            "operationId": "get_progress_list",
            "summary": "The token's user's progress on up to 100 contents of one type, at its freshest",
            "description": "One entry per id that has progress, in the order asked; ids without progress are left out.",
            "security": [{"bearerAuth": []}],
            "parameters": [
                _CONTENT_TYPE_PARAMETER,
                {
                    "name": "ids",
                    "in": "query",
                    "required": True,
                    "style": "form",
                    "explode": False,
                    "description": "Comma-separated content ids: `ids=1,2,3`.",
                    "schema": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": MAX_IDS,
                        "items": {"type": "integer", "minimum": 1, "maximum": MAX_ID},
                    },
                },
            ],
            "responses": {
                "200": {
                    "description": "The freshest positions.",
                    "content": _json_content("ProgressList", {"data": [_PROGRESS_EXAMPLE]}),
                },
                **_READ_ERRORS,
            },
        }
    }
    sync = {
        "post": {
            "operationId": "post_progress_sync",
            "summary": "Positions listened offline, uploaded later",
            "description": "Each item goes through the heartbeat buffer with `listened_at` as its time (a time "
            "more than SYNC_MAX_BACKDATE_HOURS before the request is stored as that edge): applied only if no "
            "later position is stored. Items are refused one by one (applied false, with a reason) when their "
            "time is too far in the future, or their content is unknown.",
            "security": [{"bearerAuth": []}],
            "requestBody": {
                "required": True,
                "content": _json_content(
                    "SyncRequest",
                    {
                        "items": [
                            {
                                "content_type": "audio",
                                "content_id": 7,
                                "position": 95.0,
                                "listened_at": "2026-11-29T21:04:00+01:00",
                            },
                            {
                                "content_type": "meditation",
                                "content_id": 3,
                                "position": 600.0,
                                "listened_at": "2026-11-29T21:30:12Z",
                            },
                        ]
                    },
                ),
            },
            "responses": {
                "200": {
                    "description": "One result per item, in request order.",
                    "content": _json_content(
                        "SyncResult",
                        {
                            "items": [
                                {"applied": True, "reason": None},
                                {"applied": False, "reason": "older than the stored position"},
                            ]
                        },
                    ),
                },
                "400": _error_response("Malformed JSON."),
                "401": _UNAUTHENTICATED,
                "408": _BODY_TIMEOUT,
                "413": _error_response("Body larger than SYNC_MAX_BODY_BYTES."),
                "422": _error_response(f"Invalid fields (1 to {SYNC_MAX_ITEMS} items); `detail` names them."),
                "429": _too_many(
                    "Too many syncs or items from this user (one call against the heartbeats' rate; "
                    "items against SYNC_ITEMS_PER_USER_PER_SECOND)."
                ),
                "503": _retry_soon(
                    "Redis or Postgres cannot take the items now, or answers too slowly for the syncs waiting (or no"
                    " database is configured); nothing was written, retry later."
                ),
            },
        }
    }
    return {ONE_ROUTE: one, MANY_ROUTE: many, SYNC_ROUTE: sync}


def build_openapi(api: FastAPI) -> dict[str, Any]:
    if api.openapi_schema:
        return api.openapi_schema
    schema = get_openapi(title=api.title, version=api.version, description=api.description, routes=api.routes)
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for kind in CONTENT_KINDS:
        model_schema = kind.body.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas[kind.body.__name__] = model_schema
        schema["paths"][kind.path] = _progress_operation(kind.name, kind.body.__name__)
    sync_schema = SyncRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(sync_schema.pop("$defs"))
    schemas["SyncRequest"] = sync_schema
    schemas["Progress"] = {
        "type": "object",
        "properties": {
            "content_type": {"type": "string", "enum": [kind.name for kind in CONTENT_KINDS]},
            "content_id": {"type": "integer", "minimum": 1, "maximum": MAX_ID},
            "position": {"type": "number", "description": "Seconds from the start."},
            "updated_at": {"type": "string", "format": "date-time", "description": "When this position was heard."},
            "completed_at": {"anyOf": [{"type": "string", "format": "date-time"}, {"type": "null"}]},
        },
        "required": ["content_type", "content_id", "position", "updated_at", "completed_at"],
    }
    schemas["ProgressList"] = {
        "type": "object",
        "properties": {"data": {"type": "array", "items": _ref("Progress")}},
        "required": ["data"],
    }
    schemas["SyncResult"] = {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "applied": {"type": "boolean"},
                        "reason": {
                            "anyOf": [{"type": "string"}, {"type": "null"}],
                            "description": "Why not applied; null when applied.",
                        },
                    },
                    "required": ["applied", "reason"],
                },
            }
        },
        "required": ["items"],
    }
    schema["paths"].update(_read_operations())
    schemas["Created"] = {
        "type": "object",
        "properties": {"data": {"type": "boolean", "const": True}},
        "required": ["data"],
    }
    schemas["Error"] = {
        "type": "object",
        "properties": {"detail": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}},
        "required": ["detail"],
    }
    components["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"}}
    schema["paths"] = dict(sorted(schema["paths"].items()))
    api.openapi_schema = schema
    return schema
