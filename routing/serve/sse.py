"""Server-sent events, both ways: reading an engine's stream (:func:`sse_batches`) and
writing events to the client (:func:`sse_events`). Parsed here: no SSE library is
installed and the maintained one (httpx-sse) reads httpx responses, not aiohttp's.

The stream is read in the chunks the network delivers, not line by line: a chunk's
complete events come out as one batch, so relaying a burst of tokens costs one client
write, not one per token (the per-token relay was most of the router's time beside a
fast fleet; docs/guides/dynamo.md)."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Sequence


def _event_data(event: bytes) -> str | None:
    """The ``data`` of one event's lines (multi-line data joined by newlines; one space
    after ``data:`` dropped, as the SSE standard says), or None."""
    lines = [
        line[6:] if line.startswith(b"data: ") else line[5:] for line in event.split(b"\n") if line.startswith(b"data:")
    ]
    return b"\n".join(lines).decode() if lines else None


async def sse_batches(chunks: AsyncIterable[bytes]) -> AsyncIterator[list[str]]:
    """The ``data`` of each server-sent event, in batches: every event completed by one
    chunk of ``chunks`` (events end at a blank line, ``\\n\\n`` or ``\\r\\n\\r\\n``); a last
    event not ended by a blank line is yielded when the stream ends. Events without data
    (comments, ``retry:``) are dropped; no batch is empty."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        if b"\r" in pending:
            pending = pending.replace(b"\r\n", b"\n")
        *complete, pending = pending.split(b"\n\n")
        batch = [data for event in complete if (data := _event_data(event)) is not None]
        if batch:
            yield batch
    last = _event_data(pending)
    if last is not None:
        yield [last]


def sse_events(data: Sequence[str]) -> bytes:
    """Server-sent events carrying each of ``data`` (one line each: JSON or ``[DONE]``)."""
    return "".join(f"data: {item}\n\n" for item in data).encode()
