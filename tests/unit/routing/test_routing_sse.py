"""The SSE reader: the same events whatever chunks the network cuts the stream into,
one batch per chunk's complete events, and the writer's bytes read back as written."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

from hypothesis import given
from hypothesis import strategies as st

from kvpilot.routing.serve.sse import sse_batches, sse_events


async def _chunks(raw: bytes, cuts: list[int]) -> AsyncIterator[bytes]:
    edges = [0, *sorted(set(cuts)), len(raw)]
    for start, end in itertools.pairwise(edges):
        if end > start:
            yield raw[start:end]


def _read(raw: bytes, cuts: list[int]) -> list[list[str]]:
    async def collect() -> list[list[str]]:
        return [batch async for batch in sse_batches(_chunks(raw, cuts))]

    return asyncio.run(collect())


_data = st.lists(st.text(alphabet='abc{}":, 01', min_size=1, max_size=12), min_size=1, max_size=8)


@given(data=_data, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10), crlf=st.booleans())
def test_every_cut_of_the_stream_gives_the_same_events(data: list[str], cuts: list[int], crlf: bool) -> None:
    raw = sse_events([*data, "[DONE]"])
    if crlf:
        raw = raw.replace(b"\n", b"\r\n")
    batches = _read(raw, [c for c in cuts if c < len(raw)])
    assert [event for batch in batches for event in batch] == [*data, "[DONE]"]
    assert all(batches)


def test_one_chunk_of_many_events_is_one_batch() -> None:
    raw = sse_events(["a", "b", "c"])
    assert _read(raw, []) == [["a", "b", "c"]]
    assert _read(raw, [len(b"data: a\n\n") + 3]) == [["a"], ["b", "c"]]


def test_multi_line_data_comments_and_an_unterminated_last_event() -> None:
    raw = b': keep-alive\n\ndata: {"x":\ndata: 1}\n\nretry: 10\n\ndata:last'
    assert _read(raw, []) == [['{"x":\n1}'], ["last"]]
