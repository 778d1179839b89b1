"""The OpenAPI document: FastAPI's own routes plus the four progress POSTs served in `ingest.py`."""

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from service.progress.content import CONTENT_KINDS


def _error_response(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


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
                "401": _error_response("Missing, malformed, expired or wrongly signed token; or two identity headers."),
                "404": _error_response("The content id does not exist (`unknown <field> <id>`); nothing written."),
                "408": _error_response("Body not received within BODY_READ_TIMEOUT_SECONDS; the connection is closed."),
                "413": _error_response("Body larger than MAX_BODY_BYTES."),
                "422": _error_response("Valid JSON, invalid fields; `detail` names each one."),
                "429": {
                    **_error_response("Too many heartbeats from this user (far above the app's rhythm)."),
                    "headers": {
                        "Retry-After": {
                            "description": "Whole seconds after which a heartbeat is accepted again.",
                            "schema": {"type": "integer", "minimum": 1},
                        }
                    },
                },
                "503": _error_response("No store can take the heartbeat now; retry later."),
            },
        }
    }


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
