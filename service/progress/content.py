"""The four kinds of content that send heartbeats: their routes, bodies and tables, in one place."""

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

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


class LessonHeartbeat(_Heartbeat):
    lesson_id: ContentId


class AudioHeartbeat(_Heartbeat):
    audio_id: ContentId


class MeditationHeartbeat(_Heartbeat):
    meditation_id: ContentId


class LiveHeartbeat(_Heartbeat):
    live_id: ContentId


@dataclass(frozen=True, slots=True, eq=False)  # the four below are the only ones: identity is equality, and hashes fast
class ContentKind:
    name: str  # the content_type of Redis keys and completion events
    path: str
    body: type[_Heartbeat]
    content_table: str
    progress_table: str
    id_column: str


CONTENT_KINDS: tuple[ContentKind, ...] = (
    ContentKind("lesson", "/engagements/progress/lesson", LessonHeartbeat,
                "courses_lesson", "engagements_lessonprogress", "lesson_id"),
    ContentKind("audio", "/audios/progress", AudioHeartbeat,
                "audios_audio", "audios_audioprogress", "audio_id"),
    ContentKind("meditation", "/meditations/progress", MeditationHeartbeat,
                "audios_meditation", "audios_meditationprogress", "meditation_id"),
    ContentKind("live", "/lives/progress", LiveHeartbeat,
                "lives_live", "lives_liveprogress", "live_id"),
)  # fmt: skip
KIND_BY_PATH = {kind.path: kind for kind in CONTENT_KINDS}
KIND_BY_NAME = {kind.name: kind for kind in CONTENT_KINDS}

# receive times, listened_at and completion dates are counted from here (ms and µs since the epoch, UTC)
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
