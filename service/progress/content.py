"""The four kinds of content that send heartbeats: their routes, bodies and tables, in one place."""

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model

MAX_POSITION_S = 86_400
MAX_ID = 2**63 - 1  # bigint

# Below 2**53 a float is exactly the integer its JSON literal spells; above, 9007199254740993.0
# would arrive as ...992, a different id.
_EXACT_FLOAT_INT = 2**53


def _whole_number(value: object) -> object:
    """`42.0` is the integer 42 in JSON Schema (openapi.yaml says `integer`); "42", true and 42.5 are not."""
    if isinstance(value, float) and value.is_integer() and abs(value) < _EXACT_FLOAT_INT:
        return int(value)
    return value


ContentId = Annotated[int, Field(ge=1, le=MAX_ID), BeforeValidator(_whole_number)]
Position = Annotated[float, Field(ge=0, le=MAX_POSITION_S, allow_inf_nan=False, description="Seconds from the start.")]


class _Heartbeat(BaseModel):
    # strict: "12" or true is not an id; unknown fields are ignored (old and new app builds send more)
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)
    position: Position


@dataclass(frozen=True, slots=True, eq=False)  # the four below are the only ones: identity is equality, and hashes fast
class ContentKind:
    name: str  # the content_type of Redis keys and completion events
    path: str
    body: type[_Heartbeat]  # LessonHeartbeat, ...: the name openapi.yaml gives its schema
    content_table: str
    progress_table: str
    id_column: str


def _kind(name: str, path: str, content_table: str, progress_table: str) -> ContentKind:
    id_column = f"{name}_id"
    fields: dict[str, Any] = {id_column: (ContentId, ...)}
    body = create_model(f"{name.capitalize()}Heartbeat", __base__=_Heartbeat, **fields)
    return ContentKind(name, path, body, content_table, progress_table, id_column)


CONTENT_KINDS: tuple[ContentKind, ...] = (
    _kind("lesson", "/engagements/progress/lesson", "courses_lesson", "engagements_lessonprogress"),
    _kind("audio", "/audios/progress", "audios_audio", "audios_audioprogress"),
    _kind("meditation", "/meditations/progress", "audios_meditation", "audios_meditationprogress"),
    _kind("live", "/lives/progress", "lives_live", "lives_liveprogress"),
)
KIND_BY_PATH = {kind.path: kind for kind in CONTENT_KINDS}
KIND_BY_NAME = {kind.name: kind for kind in CONTENT_KINDS}

# receive times, listened_at and completion dates are counted from here (ms and µs since the epoch, UTC)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
