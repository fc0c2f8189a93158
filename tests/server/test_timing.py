"""The Server-Timing header's spans (the live header is checked in test_chat_openai)."""

from __future__ import annotations

from agentkv.server.timing import header, parse


def test_server_timing_header_names_only_marked_spans():
    assert header({"arrived": 1.0}) is None   # an answer that never reached the engine
    assert header({"arrived": 1.0, "context_start": 1.001, "context_end": 1.0015, "engine_sent": 1.002,
                   "engine_answered": 1.0525}) == b"front;dur=2.00, engine;dur=50.50, context;dur=0.50"


def test_server_timing_read_back():
    assert parse("front;dur=2.00, engine;dur=50.50, context;dur=0.50") == {"front": 2.0, "engine": 50.5,
                                                                          "context": 0.5}
    assert parse('cache;desc="hit", db;dur=53;desc="query"') == {"db": 53.0}   # the W3C example
    assert parse("") == {}
