"""Sessions: who a request belongs to, its log, and the compacted view the engine is sent.

The client sends its whole conversation every time. The session keeps, in the log database,
the keys of the conversation it has seen and the edits applied so far (replaced messages and the
summary), so the view stays the same from one request to the next (the prefix cache survives)
and changes only when a policy edit fires. Every new message is appended to the log before any
edit is applied; the log is never rewritten.

Which session: the client's own id where it sends one (``SOURCES``, first present wins), else an
id derived from the conversation's first system and user messages. A derived id never merges two
conversations: when the stored history is neither a prefix of the incoming conversation nor
continued by it, the conversation gets a fork ``auto-<hash>.N`` of its own.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...compaction.prompt import Message, message_key
from ...compaction.log.session_log import LogTransaction, SessionLog
from ..errors import APIError

# no "/" or "\\" and not only dots: an id is never a path, and could not be made one
SESSION_ID = re.compile(r"^(?!\.+$)[A-Za-z0-9._:@-]{1,128}$")
_UUID = re.compile(r"session_?([0-9a-fA-F-]{36})")


def _header(name: str) -> Callable[[Mapping, Mapping], Any]:
    return lambda headers, body: headers.get(name)


def _metadata_session(headers: Mapping, body: Mapping) -> str | None:
    """Anthropic ``metadata.user_id``: Claude Code sends a JSON string holding ``session_id``
    (older versions: ``user_<hash>_account_<uuid>_session_<uuid>``)."""
    user = (body.get("metadata") or {}).get("user_id") if isinstance(body.get("metadata"), dict) else None
    if not isinstance(user, str):
        return None
    try:
        parsed = json.loads(user)
        if isinstance(parsed, dict) and isinstance(parsed.get("session_id"), str):
            return parsed["session_id"]
    except ValueError:
        pass
    m = _UUID.search(user)
    return m.group(1) if m else None


# (name, getter, agentkv's own): the documented precedence, first present wins. agentkv's own
# fields must be valid ids (400 otherwise); a client's id that is not is hashed into one.
SOURCES: tuple[tuple[str, Callable[[Mapping, Mapping], Any], bool], ...] = (
    ("x-session-id", _header("x-session-id"), True),
    ("session_id", lambda h, b: b.get("session_id") or h.get("session_id"), True),  # body; pi: a header
    ("x-claude-code-session-id", _header("x-claude-code-session-id"), False),
    ("session-id", _header("session-id"), False),
    ("thread-id", _header("thread-id"), False),
    ("metadata.user_id", _metadata_session, False),
    ("prompt_cache_key", lambda h, b: b.get("prompt_cache_key"), False),
)


@dataclass(frozen=True)
class SessionRef:
    """The session a request names: ``id`` (None: derive one from the conversation) and where the
    id came from (a name in ``SOURCES``, or ``derived``)."""

    id: str | None
    source: str = "derived"


def session_ref(headers: Mapping[str, str], body: Mapping[str, Any]) -> SessionRef:
    """The client's own session id, by the documented precedence (README, "Sessions")."""
    for name, get, own in SOURCES:
        value = get(headers, body)
        if value is None or value == "":
            continue
        value = str(value)
        if not SESSION_ID.match(value):
            if own:
                raise APIError(400, "session id must be 1-128 characters of letters, digits and ._:@- "
                                    "(not only dots)", param="session_id")
            value = "h-" + hashlib.sha256(value.encode()).hexdigest()[:32]
        return SessionRef(value, name)
    return SessionRef(None)


def session_key(owner: str, session_id: str) -> tuple[str, str]:
    """(storage key, public id) of an explicit id; sessions are namespaced by the caller's key."""
    if not SESSION_ID.match(session_id):
        raise APIError(400, "session id must be 1-128 characters of letters, digits and ._:@- (not only dots)",
                       param="session_id")
    return f"{owner}/{session_id}", session_id


def derived_id(messages: list[Message]) -> str:
    """An id from the conversation's first system and first user message (stable as it grows)."""
    first = [m for m in messages if m.get("role") in ("system", "developer")][:1] + \
            [m for m in messages if m.get("role") == "user"][:1]
    return "auto-" + hashlib.sha256(json.dumps(first, sort_keys=True).encode()).hexdigest()[:24]


@dataclass
class ViewState:
    """Edits in force, by conversation index: ``replaced[i]`` stands for message i;
    ``summary`` stands for messages ``[summary_start, summary_end)``."""

    keys: list[str] = field(default_factory=list)
    replaced: dict[int, Message] = field(default_factory=dict)
    summary: Message | None = None
    summary_start: int = 0
    summary_end: int = 0

    @classmethod
    def load(cls, raw: dict | None) -> ViewState:
        if not raw:
            return cls()
        return cls(raw["keys"], {int(k): v for k, v in raw["replaced"].items()}, raw["summary"],
                   raw["summary_start"], raw["summary_end"])

    def dump(self) -> dict:
        return {"keys": self.keys, "replaced": {str(k): v for k, v in self.replaced.items()},
                "summary": self.summary, "summary_start": self.summary_start, "summary_end": self.summary_end}

    def forget_from(self, n: int) -> None:
        """The conversation diverged at index n: edits at or after it no longer apply."""
        self.replaced = {i: m for i, m in self.replaced.items() if i < n}
        if self.summary is not None and self.summary_end > n:
            self.summary, self.summary_start, self.summary_end = None, 0, 0

    def view(self, messages: list[Message]) -> tuple[list[Message], list[int]]:
        """The messages the engine sees, and for each the conversation index it stands for
        (the summary stands for the first message it replaces)."""
        out, where = [], []
        for i, m in enumerate(messages):
            if self.summary is not None and self.summary_start <= i < self.summary_end:
                if i == self.summary_start:
                    out.append(self.summary)
                    where.append(i)
                continue
            out.append(self.replaced.get(i, m))
            where.append(i)
        return out, where


def _common(a: list[str], b: list[str]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case (a conversation that grew), compared in C
        return n
    return next(i for i in range(n) if a[i] != b[i])


def _continues(stored: dict | None, keys: list[str]) -> bool:
    """The stored conversation and the incoming one are the same conversation: one is a prefix of
    the other (a next turn, or a retry of an earlier one)."""
    if not stored:
        return True
    old = stored["keys"]
    return _common(old, keys) == min(len(old), len(keys))


@dataclass
class Synced:
    key: str          # storage key (owner/id)
    id: str           # public id (X-Session-Id)
    state: ViewState


class Sessions:
    """The session log plus per-session view state. Methods are blocking (SQLite)."""

    def __init__(self, log: SessionLog):
        self.log = log

    def sync(self, owner: str, ref: SessionRef, messages: list[Message], keys: list[str] | None = None) -> Synced:
        """Find the session, append the messages its log has not seen (before any edit) and return
        its view state: one transaction, so concurrent requests on one session append each message once.
        ``keys``: the messages' ``message_key`` where the caller has them (``KnownMessages``)."""
        keys = [message_key(m) for m in messages] if keys is None else keys
        if ref.id is not None:
            key, sid = session_key(owner, ref.id)
            with self.log.transaction(key) as tx:
                return Synced(key, sid, self._merge(tx, key, tx.get_state(key), keys, messages))
        base = derived_id(messages)
        lock = f"{owner}/{base}"
        with self.log.transaction(lock) as tx:
            forks = tx.states_like(lock)
            numbers = [0] + [int(k.rsplit(".", 1)[1]) for k in forks if k != lock and k.rsplit(".", 1)[1].isdigit()]
            candidates = [lock] + [f"{lock}.{n}" for n in sorted(numbers[1:])]
            key = next((k for k in candidates if _continues(forks.get(k), keys)), f"{lock}.{max(numbers) + 1}")
            return Synced(key, key.split("/", 1)[1], self._merge(tx, key, forks.get(key), keys, messages))

    @staticmethod
    def _merge(tx: LogTransaction, key: str, raw: dict | None, keys: list[str],
               messages: list[Message]) -> ViewState:
        state = ViewState.load(raw)
        common = _common(keys, state.keys)
        if common < len(state.keys):
            state.forget_from(common)
        state.keys = keys
        tx.append(key, messages[common:])
        tx.put_state(key, state.dump())
        return state

    def save(self, key: str, state: ViewState) -> None:
        self.log.put_state(key, state.dump())
