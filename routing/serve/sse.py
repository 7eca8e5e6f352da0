"""Server-sent events, both ways: reading an engine's stream (:func:`sse_data`) and
writing one event to the client (:func:`sse_event`). Parsed here: no SSE library is
installed and the maintained one (httpx-sse) reads httpx responses, not aiohttp's."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator


async def sse_data(content: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event (multi-line data joined by newlines)."""
    lines: list[str] = []
    async for raw in content:
        line = raw.decode().rstrip("\r\n")
        if line.startswith("data:"):
            lines.append(line[5:].lstrip(" "))
        elif not line and lines:
            yield "\n".join(lines)
            lines = []
    if lines:
        yield "\n".join(lines)


def sse_event(data: str) -> bytes:
    """One server-sent event carrying ``data`` (one line: JSON or ``[DONE]``)."""
    return f"data: {data}\n\n".encode()
