"""The reads' fast paths against the long ways they stand for: the same ids, refusals, values, keys and text.

A read of 100 ids takes its query, its buffered values, its key names and its times' text each by a
shortcut (bytes instead of text, tables instead of format specs). Each must answer exactly what the
general code it skips would: checked on the bad-input classes of test_reads.py, on hand-picked edges
and on generated inputs.
"""

from collections.abc import Callable
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.api.http import HttpError
from service.api.reads import iso_utc, read_ids, read_ids_the_long_way
from service.progress.content import EPOCH, MAX_ID
from service.progress.ingest.buffer import decode_value
from service.progress.keys import KeyLayout
from service.progress.read.reads import decode_values


def outcome(parse: Callable[[bytes], list[int]], query: bytes) -> list[int] | tuple[int, object]:
    try:
        return parse(query)
    except HttpError as exc:
        return exc.status, exc.detail


QUERIES = [
    b"ids=1", b"ids=5,4,3,2,4,1000", b"ids=" + ",".join(str(i) for i in range(1, 101)).encode(),
    b"", b"ids", b"ids=", b"ids=1,x", b"ids=1,,2", b"ids=1&ids=2", b"ids=1,2&ids=3", b"ids=1&x=2", b"x=1&ids=2",
    b"ids=" + ",".join(str(i) for i in range(1, 102)).encode(), b"ids=0", b"ids=-1", b"ids=+1", b"ids=1.0",
    b"ids=9223372036854775807", b"ids=9223372036854775808", b"ids=" + b"9" * 21, b"ids=00000000000000000001",
    b"ids=%31", b"ids=1%2C2", b"ids=1+2", b"ids= 1", b"ids=1 ", b"ids=%D9%A1", b"ids=\xd9\xa1", b"ids=1,",
    b"IDS=1", b"ids=1&", b"&ids=1", b"ids=1;2", b"ids==1",
]  # fmt: skip


@pytest.mark.parametrize("query", QUERIES)
def test_a_query_reads_as_the_long_way_reads_it(query: bytes) -> None:
    assert outcome(read_ids, query) == outcome(read_ids_the_long_way, query)


@given(
    st.lists(st.sampled_from(["0", "1", "9", "42", "", ",", "&", "=", "%31", "+", "-", " ", "x", "ids="]), max_size=12)
)
def test_any_query_reads_as_the_long_way_reads_it(parts: list[str]) -> None:
    query = ("ids=" + "".join(parts)).encode()
    assert outcome(read_ids, query) == outcome(read_ids_the_long_way, query)


@given(st.lists(st.integers(min_value=-5, max_value=MAX_ID + 5), min_size=1, max_size=105))
def test_any_list_of_ids_reads_as_the_long_way_reads_it(ids: list[int]) -> None:
    query = ("ids=" + ",".join(map(str, ids))).encode()
    assert outcome(read_ids, query) == outcome(read_ids_the_long_way, query)


# from the epoch to the year 9999: what a timestamptz of a row or a receive time in µs can hold here
@given(st.integers(min_value=0, max_value=253_402_300_799_999_999))
def test_a_time_is_written_as_isoformat_writes_it(us: int) -> None:
    assert iso_utc(us) == (EPOCH + timedelta(microseconds=us)).isoformat()


@pytest.mark.parametrize(
    "us", [0, 1, 999, 1000, 999_999, 1_000_000, 86_399_999_999, 86_400_000_000, 1_796_034_958_972_001]
)
def test_edge_times_are_written_as_isoformat_writes_them(us: int) -> None:
    assert iso_utc(us) == (EPOCH + timedelta(microseconds=us)).isoformat()


def by_decode_value(raw: bytes) -> tuple[float, int, float, int | None] | None:
    try:
        value = decode_value(raw)
    except ValueError:
        return None
    floor_ms = value.completion_floor_ms
    return value.position, round(value.received_ms * 1000), value.peak, None if floor_ms is None else floor_ms * 1000


FIELDS = st.one_of(
    st.floats(allow_nan=False).map(repr),
    # below 2**41 ms (September 2039) either way: the flush's decoder keeps a receive time as float ms, and float ms
    # times 1000, rounded, gives the µs back exactly up to there (its step and the product's error stay under half a
    # µs); at 2**42 ms a receive time may come back one µs off (found by this test: 4398046511104 ms, 94 µs)
    st.integers(min_value=-(2**41) + 1, max_value=2**41 - 1).map(str),
    st.sampled_from(["", "nan", "inf", "1_0", " 5", "5 ", "\u0661", "1e3", "0x1", "-", "é"]),
)


@given(st.lists(FIELDS, min_size=1, max_size=6))
def test_any_buffered_value_decodes_as_the_flush_decodes_it(fields: list[str]) -> None:
    raw = ":".join(fields).encode()
    [decoded] = decode_values([raw])
    assert repr(decoded) == repr(by_decode_value(raw))  # repr: a nan position is the same nan


@pytest.mark.parametrize(
    "raw",
    [
        b"130.25:1796034958972:140.0:123",
        b"5:1796034958972",
        b"5:1796034958972:9",
        b"600:1796034958972:600:7:1796099999000",  # an offline item's, with its completion floor
        b"600:1796034958972:600:7:x",
        b"42.5",
        b"\xff:1:2:3",
        b"",
    ],
)
def test_edge_buffered_values_decode_as_the_flush_decodes_them(raw: bytes) -> None:
    assert decode_values([raw, None]) == [by_decode_value(raw), None]
    if raw.isascii():  # the same value, had the client decoded it
        assert decode_values([raw.decode()]) == [by_decode_value(raw)]


@pytest.mark.parametrize(("shards", "cluster"), [(1, False), (1, True), (7, False), (60, True)])
def test_a_reads_keys_are_the_value_keys_of_its_ids(shards: int, cluster: bool) -> None:
    layout = KeyLayout(shards=shards, cluster=cluster)
    ids = [1, 2, 99, 2**63 - 1]
    assert layout.value_keys("audio", 7, ids) == [layout.value_key("audio", content_id, 7) for content_id in ids]
