"""Recall: word search over one session's full log, cleared and summarized history included.

Words, not a phrase: every word must occur in the message or in the call it answered (so
``media timeout`` finds ``timeout_ms = 1050`` in the output of ``diag.py media``); each word also
matches as a prefix (``timeout`` matches ``timeout_ms``). Tool outputs rank first, then BM25
(SQLite) or the most recent (PostgreSQL).
Returns the matching lines with their message id.
"""

from __future__ import annotations

from dataclasses import dataclass

from .session_log import WORD as _WORD
from .session_log import SessionLog
from .session_log import words as _words


@dataclass(frozen=True)
class Hit:
    message_id: int
    role: str
    call: str
    lines: tuple[str, ...]


def _matches(text: str, word: str) -> bool:
    return any(t.lower().startswith(word) for t in _WORD.findall(text))


def _matching_lines(body: str, call: str, words: list[str], max_lines: int) -> tuple[str, ...]:
    """Lines holding the words the call itself does not explain, most words first."""
    own = [w for w in words if not _matches(call, w)] or words
    scored = []
    for n, line in enumerate(body.splitlines()):
        hits = sum(_matches(line, w) for w in own)
        if hits:
            scored.append((-hits, n, line.strip()))
    return tuple(line for _, _, line in sorted(scored)[:max_lines])


def recall(log: SessionLog, session: str, query: str, limit: int = 5, max_lines: int = 8) -> list[Hit]:
    words = _words(query)
    if not words:
        return []
    hits: list[Hit] = []
    for all_words in (True, False):  # all words first; any word if nothing has all of them
        for mid, role, call, body in log.search(session, words, all_words, limit):
            lines = _matching_lines(body, call, words, max_lines) or tuple(body.splitlines()[:1])
            hits.append(Hit(mid, role, call, lines))
        if hits:
            break
    return hits


def format_hits(hits: list[Hit]) -> str:
    """Text for a model: one block per message, lines prefixed with the message id."""
    if not hits:
        return "No match in the session log."
    blocks = []
    for h in hits:
        src = f" (output of {h.call})" if h.call else ""
        blocks.append(f"[message {h.message_id}, {h.role}{src}]\n" + "\n".join(h.lines))
    return "\n\n".join(blocks)
