"""The OpenAPI document: `openapi.yaml` beside this module is the API's contract, served as is.

Written by hand, not generated: most routes are plain ASGI (`routes.py`), so a generated document
would be a hand-built dict anyway. Why the file is the one source: docs/design.md, "The API contract".
"""

from functools import cache
from importlib.resources import files
from typing import Any

import yaml

DOCUMENT = files("service.api").joinpath("openapi.yaml")


def openapi_text() -> str:
    return DOCUMENT.read_text(encoding="utf-8")


@cache
def openapi_document() -> dict[str, Any]:
    """The document, loaded once per process; FastAPI serves it at /openapi.json."""
    document: dict[str, Any] = yaml.safe_load(openapi_text())
    return document
