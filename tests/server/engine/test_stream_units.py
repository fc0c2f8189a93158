"""The relay's parsing of the engine's event stream, on byte streams cut anywhere."""

from __future__ import annotations

import asyncio
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.server.pipeline.engine_call import decode_json, sse_data

CHUNKS = [{"id": "c", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
          for text in ["plain", "line\u2028sep and \u2029para", "new\nline", "\u00e9t\u00e9 \U0001f600", "quote \" \\"]]


def _payloads(raw: bytes, cuts: list[int]) -> list[bytes]:
    edges = sorted({0, len(raw), *(c % (len(raw) + 1) for c in cuts)})

    async def parts():   # the body as the socket might hand it over
        for a, b in zip(edges, edges[1:]):
            yield raw[a:b]

    async def collect():
        return [d async for d in sse_data(parts())]
    return asyncio.run(collect())


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 10_000), max_size=12), ascii_only=st.booleans())
def test_events_survive_any_cut_and_any_text(cuts, ascii_only):
    raw = b"".join(b"data: " + json.dumps(c, ensure_ascii=ascii_only).encode() + b"\n\n" for c in CHUNKS)
    raw += b": a comment\n\ndata: [DONE]\n\n"
    got = _payloads(raw, cuts)
    assert got[-1] == b"[DONE]"
    assert [decode_json(d) for d in got[:-1]] == CHUNKS  # U+2028 inside a JSON string is not a line break


def test_decode_json_reads_what_json_reads():
    for text in ['{"a": [1, 2.5, null, true], "b": "\\u00e9"}', '{"logprob": -Infinity, "x": NaN}']:
        a, b = decode_json(text.encode()), json.loads(text)
        assert json.dumps(a) == json.dumps(b)
