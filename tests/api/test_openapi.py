"""service/api/openapi.yaml is the contract, served as is; these hold it to the code (test_fuzz.py: to the answers)."""

from typing import Any

import yaml
from fastapi.openapi.utils import get_openapi

from service.api.openapi import DOCUMENT
from service.api.reads import MANY_ROUTE, MAX_IDS, ONE_ROUTE
from service.api.routes import OPENAPI_ROUTE, Routes
from service.progress.content import CONTENT_KINDS, MAX_ID
from service.progress.read.sync import SYNC_MAX_ITEMS, SyncRequest

REF = "#/components/schemas/{model}"


def committed() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(DOCUMENT.read_text(encoding="utf-8"))
    return document


async def test_the_app_serves_openapi_yaml_as_is(client) -> None:  # type: ignore[no-untyped-def]
    assert (await client.get("/openapi.json")).json() == committed()


def test_the_document_has_exactly_the_route_tables_paths(app: Routes) -> None:
    tabled = {path for path in app.table if path != OPENAPI_ROUTE} | {ONE_ROUTE, MANY_ROUTE}
    assert set(committed()["paths"]) == tabled


def test_fastapis_own_routes_are_documented_as_fastapi_describes_them(app: Routes) -> None:
    generated = get_openapi(title="", version="", routes=app.api.routes)
    document = committed()
    for path, operations in generated["paths"].items():
        assert document["paths"][path] == operations, path
    for name, schema in generated["components"]["schemas"].items():
        assert document["components"]["schemas"][name] == schema, name


def test_the_request_bodies_are_the_models_the_routes_validate_with() -> None:
    schemas = committed()["components"]["schemas"]
    for kind in CONTENT_KINDS:
        assert schemas[kind.body.__name__] == kind.body.model_json_schema(ref_template=REF)
        operation = committed()["paths"][kind.path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(kind.body.__name__)
    sync = SyncRequest.model_json_schema(ref_template=REF)
    for name, schema in sync.pop("$defs").items():
        assert schemas[name] == schema
    assert schemas["SyncRequest"] == sync
    assert sync["properties"]["items"]["maxItems"] == SYNC_MAX_ITEMS


def test_the_reads_parameters_are_the_codes_bounds() -> None:
    paths = committed()["paths"]
    names = [kind.name for kind in CONTENT_KINDS]
    one = {p["name"]: p["schema"] for p in paths[ONE_ROUTE]["get"]["parameters"]}
    many = {p["name"]: p["schema"] for p in paths[MANY_ROUTE]["get"]["parameters"]}
    assert one["content_type"]["enum"] == many["content_type"]["enum"] == names
    assert (one["content_id"]["minimum"], one["content_id"]["maximum"]) == (1, MAX_ID)
    assert (many["ids"]["maxItems"], many["ids"]["items"]["maximum"]) == (MAX_IDS, MAX_ID)
    progress = committed()["components"]["schemas"]["Progress"]["properties"]
    assert progress["content_type"]["enum"] == names


def test_the_progress_routes_document_their_refusals() -> None:
    for kind in CONTENT_KINDS:
        operation = committed()["paths"][kind.path]["post"]
        assert set(operation["responses"]) >= {"201", "400", "401", "404", "408", "413", "422", "503"}
        body = committed()["components"]["schemas"][kind.body.__name__]
        assert set(body["required"]) == {kind.id_column, "position"}
