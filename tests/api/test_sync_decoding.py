"""The sync's one-pass decode (msgspec) against SyncRequest (pydantic): the same items, the same refusals.

`plain_items` decodes the shape every app build sends; whatever it does not take goes to
SyncRequest, which words the refusal. So the two must never disagree on what they both take, and
`plain_items` must take nothing SyncRequest refuses: checked on the bad-input classes of
test_sync.py (through HTTP, detail for detail), on hand-picked edges, and on generated bodies.
"""

import json
import math
from datetime import UTC, datetime

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from redis.asyncio import Redis

from service.api.http import invalid_body
from service.progress.read.sync import OfflineItem, SyncRequest, parse_request, plain_items
from tests.helpers import BAD_SYNCS, auth


def by_pydantic(body: bytes) -> list[OfflineItem] | ValidationError:
    try:
        return [OfflineItem.of(item) for item in SyncRequest.model_validate_json(body).items]
    except ValidationError as exc:
        return exc


def assert_agrees(body: bytes) -> list[OfflineItem] | None:
    plain, reference = plain_items(body), by_pydantic(body)
    if plain is not None:
        assert plain == reference, body  # also: a NaN position, never taken by either, cannot slip through
        # the same text in Redis: the script stores repr(position)
        assert [repr(item.position) for item in plain] == [repr(item.position) for item in reference]
    else:
        parsed = parse_request(body) if not isinstance(reference, ValidationError) else None
        assert parsed is None or parsed == reference
    return plain


def body_of(*items: dict[str, object], **extra: object) -> bytes:
    return json.dumps({"items": list(items), **extra}).encode()


def an_item(**fields: object) -> dict[str, object]:
    return {"content_type": "audio", "content_id": 1, "position": 1.5, "listened_at": "2026-11-30T10:00:00Z", **fields}


@pytest.mark.parametrize(("body", "status", "named"), BAD_SYNCS)
async def test_every_bad_sync_gets_pydantics_own_answer(
    client: httpx.AsyncClient, redis: Redis, token: str, body: bytes, status: int, named: str
) -> None:
    assert plain_items(body) is None  # refused by the one-pass decode: SyncRequest words the answer
    reference = by_pydantic(body)
    assert isinstance(reference, ValidationError)
    expected = invalid_body(reference)
    response = await client.post("/progress/sync", content=body, headers=auth(token))
    assert (response.status_code, response.json()) == (expected.status, {"detail": expected.detail})
    assert response.status_code == status
    assert await redis.keys("*") == []


EVERY_KIND = [
    an_item(content_id=i, content_type=t) for i in range(1, 126) for t in ("lesson", "audio", "meditation", "live")
]
COMMON_BODIES = [
    body_of(an_item()),  # JavaScript's toISOString without milliseconds
    body_of(an_item(listened_at="2026-11-30T10:00:00.123Z")),  # toISOString
    body_of(an_item(listened_at=datetime(2026, 11, 30, 10, 0, 0, 123456, UTC).isoformat())),  # "+00:00"
    body_of(an_item(listened_at="2026-11-30T11:00:00.5+01:00", position=0)),  # an integer position
    body_of(an_item(listened_at="2026-11-30T04:30:00-05:30", position=86400, content_type="live")),
    body_of(*EVERY_KIND),  # 500 items
    body_of(an_item(extra={"nested": [1, "x", None]}), pad="ignored"),  # unknown fields are ignored
    body_of(an_item(content_id=2**63 - 1)),
]


@pytest.mark.parametrize("body", COMMON_BODIES)
def test_what_the_apps_send_takes_the_one_pass_decode_with_pydantics_values(body: bytes) -> None:
    plain = assert_agrees(body)
    assert plain is not None and len(plain) == len(json.loads(body)["items"])


EDGES = [
    body_of(an_item(content_id=1.0)),  # 1.0 is the integer 1 for pydantic: taken there, not here
    body_of(an_item(content_id=2**63)),
    body_of(an_item(content_id=0)),
    body_of(an_item(content_id=True)),
    body_of(an_item(position=True)),
    body_of(an_item(position=86400.0000001)),
    body_of(an_item(position=-0.0)),
    body_of(an_item(position="1.5")),
    body_of(an_item(listened_at="2026-11-30T10:00:00.1234567Z")),  # beyond microseconds: pydantic's to judge
    body_of(an_item(listened_at="2026-11-30t10:00:00z")),
    body_of(an_item(listened_at="2026-11-30 10:00:00Z")),
    body_of(an_item(listened_at="2026-11-30T10:00Z")),
    body_of(an_item(listened_at="2026-11-30T10:00:00+0100")),
    body_of(an_item(listened_at="2026-11-30T24:00:00Z")),
    body_of(an_item(listened_at="2026-02-30T10:00:00Z")),
    body_of(an_item(listened_at="2026-11-30T10:00:60Z")),
    body_of(an_item(listened_at="2026-11-30T10:00:00+24:00")),
    body_of(an_item(listened_at="2026-11-30T10:00:00Z ")),
    body_of(an_item(content_type="Audio")),
    b'{"items": [' + json.dumps(an_item()).encode()[:-1] + b', "x": "\xff"}]}',  # not UTF-8 in an ignored field
    b'{"items": [' + json.dumps(an_item()).encode()[:-1] + b', "x": "\\ud800"}]}',  # a lone surrogate
    b'{"items": [' + json.dumps(an_item()).encode()[:-1] + b', "x": 1e999}]}',
    b'{"items": [' + json.dumps(an_item()).encode()[:-1] + b', "position": 2.5}]}',  # a repeated field: the last
    b'{"items": [' + json.dumps(an_item()).encode()[:-1] + b', "position": NaN}]}',
    b'{"items": [' + json.dumps(an_item()).encode() + b'], "items": []}',
    b'{"items": [' + json.dumps(an_item()).encode() + b"]} trailing",
    b'\xef\xbb\xbf{"items": [' + json.dumps(an_item()).encode() + b"]}",
    b'{"items": {"0": ' + json.dumps(an_item()).encode() + b"}}",
    b'[{"items": []}]',
    b"",
    b"null",
]


@pytest.mark.parametrize("body", EDGES)
def test_edges_are_never_taken_differently(body: bytes) -> None:
    assert_agrees(body)


_TIMES = st.one_of(
    st.datetimes(min_value=datetime(1990, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC)).map(
        lambda moment: moment.isoformat()
    ),
    st.from_regex(r"\A\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}(:\d{2}(\.\d{1,9})?)?([Zz]|[+-]\d{2}:?\d{2})?\Z"),
    st.text(max_size=30),
    st.integers(),
)
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=10))


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "content_type": st.one_of(
                    st.sampled_from(["lesson", "audio", "meditation", "live", "podcast"]), _VALUES
                ),
                "content_id": st.one_of(st.integers(min_value=-2, max_value=2**64), st.floats(0, 2**64), _VALUES),
                "position": st.one_of(st.floats(-1, 86401), st.integers(-1, 86401), _VALUES),
                "listened_at": _TIMES,
            },
            optional={"extra": _VALUES},
        ),
        max_size=4,
    )
)
def test_generated_bodies_are_never_taken_differently(items: list[dict[str, object]]) -> None:
    body = json.dumps({"items": items}, allow_nan=True).encode()
    plain = assert_agrees(body)
    if plain is not None:
        assert all(math.isfinite(item.position) for item in plain)
