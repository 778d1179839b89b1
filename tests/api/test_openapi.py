from pathlib import Path

import yaml

from service.api.ingest import ProgressIngest
from service.progress.content import CONTENT_KINDS

OPENAPI_FILE = Path(__file__).resolve().parents[2] / "openapi.yaml"


def test_openapi_yaml_is_exactly_what_the_app_serves(app: ProgressIngest) -> None:
    committed = yaml.safe_load(OPENAPI_FILE.read_text())
    assert committed == app.app.openapi(), "openapi.yaml is stale: run `progress-service openapi > openapi.yaml`"


async def test_the_served_document_lists_every_progress_route(client) -> None:  # type: ignore[no-untyped-def]
    served = (await client.get("/openapi.json")).json()
    for kind in CONTENT_KINDS:
        operation = served["paths"][kind.path]["post"]
        assert set(operation["responses"]) >= {"201", "400", "401", "413", "422"}
        body = served["components"]["schemas"][kind.body.__name__]
        assert set(body["required"]) == {kind.id_column, "position"}
