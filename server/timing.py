"""Where a request's time went before its response started: the W3C ``Server-Timing`` header.

``front``: from the request's arrival to its first engine request (the body's parsing and
validation, the context step, KV reuse's planning): what agentkv adds to time to first token.
``engine``: that request to the engine's response headers (a stream: its admission; otherwise
the whole generation). ``context``: the context step alone (session log, view, policy edits).
Each is marked once per request, the first time (a priming request or a server-tool round later
does not move it); the marks live in a context variable the front's middleware sets per request.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

_MARKS: ContextVar[dict[str, float] | None] = ContextVar("agentkv_timing", default=None)
SPANS = (("front", "arrived", "engine_sent"), ("engine", "engine_sent", "engine_answered"),
         ("context", "context_start", "context_end"))


def start() -> dict[str, float]:
    """A request arrived: its marks, in the current context (tasks and threads it starts share them)."""
    marks = {"arrived": time.perf_counter()}
    _MARKS.set(marks)
    return marks


def mark(name: str) -> None:
    marks = _MARKS.get()
    if marks is not None and name not in marks:
        marks[name] = time.perf_counter()


def header(marks: dict[str, float]) -> bytes | None:
    """``front;dur=1.23, engine;dur=…`` (milliseconds) for the spans that were marked, or None."""
    parts = [f"{name};dur={1e3 * (marks[b] - marks[a]):.2f}" for name, a, b in SPANS if a in marks and b in marks]
    return ", ".join(parts).encode() if parts else None


def parse(value: str) -> dict[str, float]:
    """A ``Server-Timing`` value read back: ``front;dur=1.2, engine;dur=3.4`` -> {"front": 1.2,
    "engine": 3.4} (milliseconds; entries without ``dur`` left out)."""
    spans = {}
    for entry in value.split(","):
        name, *params = (p.strip() for p in entry.split(";"))
        for p in params:
            if p.startswith("dur="):
                spans[name] = float(p[4:])
    return spans
