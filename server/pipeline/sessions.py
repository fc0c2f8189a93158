"""Sessions: who a request belongs to, its log, and the compacted view the engine is sent.

The client sends its whole conversation every time. The session keeps, in the log database,
the keys of the conversation it has seen and the edits applied so far (replaced messages and the
summary), so the view stays the same from one request to the next (the prefix cache survives)
and changes only when a policy edit fires. Every new message is appended to the log before any
edit is applied; the log is never rewritten.

Which session: the client's own id where it sends one (``SOURCES``, first present wins), else one
derived from the conversation (see ``Sessions``). Conversations under one explicit id are branches
of that session; a conversation without one never joins a session holding anything it did not send.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agentkv.compaction.log.session_log import LogTransaction, SessionLog
from agentkv.compaction.prompt import Message, message_key
from agentkv.server.errors import APIError

# no "/" or "\\" and not only dots: an id is never a path, and could not be made one
SESSION_ID = re.compile(r"(?!\.+\Z)[A-Za-z0-9._:@-]{1,128}")   # whole ids only (fullmatch: "$" takes a final "\n")
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
    """The client's own session id, by the documented precedence (docs/sessions-and-threads.md)."""
    for name, get, own in SOURCES:
        value = get(headers, body)
        if value is None or value == "":
            continue
        value = str(value)
        if not SESSION_ID.fullmatch(value):
            if own:
                raise APIError(400, "session id must be 1-128 characters of letters, digits and ._:@- "
                                    "(not only dots)", param="session_id")
            value = "h-" + hashlib.sha256(value.encode()).hexdigest()[:32]
        return SessionRef(value, name)
    return SessionRef(None)


def session_key(owner: str, session_id: str) -> tuple[str, str]:
    """(storage key, public id) of an explicit id; sessions are namespaced by the caller's key."""
    if not SESSION_ID.fullmatch(session_id):
        raise APIError(400, "session id must be 1-128 characters of letters, digits and ._:@- (not only dots)",
                       param="session_id")
    return f"{owner}/{session_id}", session_id


def derived_id(messages: list[Message]) -> str:
    """The base of a derived id, from the conversation's first system and first user message (stable
    as it grows); each conversation's id is this base and a random token (``Sessions.open``)."""
    first = [m for m in messages if m.get("role") in ("system", "developer")][:1] + \
            [m for m in messages if m.get("role") == "user"][:1]
    return "auto-" + message_key(first)[:24]


@dataclass
class ViewState:
    """Edits in force, by conversation index: ``replaced[i]`` stands for message i;
    ``summary`` stands for messages ``[summary_start, summary_end)``."""

    keys: list[str] = field(default_factory=list)
    replaced: dict[int, Message] = field(default_factory=dict)
    summary: Message | None = None
    summary_start: int = 0
    summary_end: int = 0
    sent: list | None = None   # [tokens, prompt_hash] of the last view prompt sent: what the connector holds
    moved: bool = False        # a shift/blend edit went to the connector: moved K/V are in this branch's cache
    version: int = 0           # bumped by every save: an edit is saved only onto the state it was made on
    ident: str = ""            # drawn when the branch is made: its state key may be reused, its identity never

    @classmethod
    def load(cls, raw: dict | None) -> ViewState:
        if not raw:
            return cls()
        return cls(raw["keys"], {int(k): v for k, v in raw["replaced"].items()}, raw["summary"],
                   raw["summary_start"], raw["summary_end"], raw.get("sent"), raw.get("moved", False),
                   raw.get("version", 0), raw.get("ident", ""))

    def dump(self) -> dict:
        return {"keys": self.keys, "replaced": {str(k): v for k, v in self.replaced.items()},
                "summary": self.summary, "summary_start": self.summary_start, "summary_end": self.summary_end,
                "sent": self.sent, "moved": self.moved, "version": self.version, "ident": self.ident}

    def copy(self) -> ViewState:
        """A copy an edit can change without touching this one (messages are never changed in place)."""
        return ViewState(list(self.keys), dict(self.replaced), self.summary, self.summary_start, self.summary_end,
                         self.sent, self.moved, self.version, self.ident)

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


MAX_BRANCHES = 32      # view states kept per explicit session; the least recently used one goes first
BRANCH = "#"           # a branch's state key: ``owner/id#N`` (``#`` is never in an id)
IDENT = "~"            # a branch's identity: ``<state key>~<drawn>`` (``~`` is never in an id, an owner or a state key)


def branch_of(identity: str) -> str:
    """The state key a branch's identity (``Synced.identity``, as the session log's turns keep it) is of."""
    return identity.partition(IDENT)[0]


@dataclass
class Synced:
    key: str          # the log's key (owner/id): every branch of a session appends to one log
    id: str           # public id (X-Session-Id)
    state: ViewState
    branch: str = ""  # the view state's key: ``key`` itself, or ``key#N`` for a further branch
    changed: bool = True   # the sync changed the branch's state (its keys, or a new branch)

    def __post_init__(self) -> None:
        self.branch = self.branch or self.key

    @property
    def identity(self) -> str:
        """What the branch is known by to the KV connector and the cache salts: its state key and the
        identity drawn when it was made (a state key is reused past ``MAX_BRANCHES``; this never is)."""
        return f"{self.branch}{IDENT}{self.state.ident}" if self.state.ident else self.branch


class Sessions:
    """The session log plus per-session view state. Methods are blocking (SQLite).

    An explicit id is the client's word that its requests belong together: conversations that
    share it (an agent's subagents, side requests) are **branches** of one session. Each branch
    keeps its own view state (its edits), and the log gets each message once: a request appends
    only what follows the longest prefix it shares with any branch. A request without an id gets a
    session only when its conversation continues a stored one of the same key entirely (every
    stored message is in it), else a fork of its own with an unguessable id (``auto-<base>.<token>``).

    A request's step is two short transactions: ``sync`` appends what the log has not seen (before
    any edit) and reads the branch's state; ``save`` writes the state with the edits the request
    made on it, only if nobody saved that branch in between (its ``version``), else the caller
    runs its edits again on the newer state. The edits themselves run outside any transaction."""

    def __init__(self, log: SessionLog):
        self.log = log

    def sync(self, owner: str, ref: SessionRef, messages: list[Message], keys: list[str] | None = None) -> Synced:
        """Find the session and its branch, append the messages its log has not seen (before any
        edit), record the conversation's keys; return the branch's state as saved.
        ``keys``: the messages' ``message_key`` where the caller has them (``KnownMessages``)."""
        keys = [message_key(m) for m in messages] if keys is None else keys
        if ref.id is not None:
            key, sid = session_key(owner, ref.id)
            with self.log.transaction(key) as tx:
                return self._put_if_changed(tx, self._branch(tx, key, sid, keys, messages))
        base = f"{owner}/{derived_id(messages)}"
        with self.log.transaction(base) as tx:
            forks = tx.states_like(base)
            fitting = [(len(s["keys"]), k) for k, s in forks.items() if k != base and BRANCH not in k
                       and _common(s["keys"], keys) == len(s["keys"])]   # stored keys: a prefix of these
            key = max(fitting)[1] if fitting else f"{base}.{secrets.token_hex(8)}"
            tx.lock(key)   # the fork's own lock too: a client may name it explicitly at the same time
            state = ViewState.load(tx.get_state(key))
            if _common(state.keys, keys) != len(state.keys):   # changed since the lookup: a fork of its own
                key, state = f"{base}.{secrets.token_hex(8)}", ViewState()
            tx.append(key, messages[len(state.keys):])
            synced = Synced(key, key.split("/", 1)[1], state)
            synced.changed = state.keys != keys
            state.keys = keys
            return self._put_if_changed(tx, synced)

    def save(self, synced: Synced, state: ViewState) -> bool:
        """Write ``state`` (the edits made on ``synced.state``) if the branch is still as synced;
        False when another request saved it meanwhile."""
        with self.log.transaction(synced.key) as tx:
            now = ViewState.load(tx.get_state(synced.branch))
            if now.version != synced.state.version:
                return False
            state.version = now.version
            self._put(tx, synced.branch, state)
            return True

    @staticmethod
    def _branch(tx: LogTransaction, key: str, sid: str, keys: list[str], messages: list[Message]) -> Synced:
        """The branch these messages share the longest prefix with (then the one they continue, then
        the most recent): that branch when its keys are a prefix of theirs, else a new branch copied
        from it, its edits before the divergence kept. The log gets what follows that prefix."""
        branches = tx.states_like(key, BRANCH)
        scored = [(n := _common(raw["keys"], keys), n == len(raw["keys"]), raw.get("used", 0), name)
                  for name, raw in branches.items()]
        if not scored:
            state, branch, n = ViewState(), key, 0
        else:
            n, continues, _, branch = max(scored)
            state = ViewState.load(branches[branch])
            if not continues:
                state.forget_from(n)
                state.moved, state.sent = False, None   # a new branch: another salt, nothing held for it yet
                state.ident = secrets.token_hex(12)     # ... and an identity of its own, whatever its state key
                branch = _new_branch(key, branches)
        tx.append(key, messages[n:])
        synced = Synced(key, sid, state, branch)
        synced.changed = state.keys != keys or branch not in branches
        state.keys = keys
        return synced

    def _put_if_changed(self, tx: LogTransaction, synced: Synced) -> Synced:
        if synced.changed:
            self._put(tx, synced.branch, synced.state)
        return synced

    @staticmethod
    def _put(tx: LogTransaction, branch: str, state: ViewState) -> None:
        state.version += 1
        raw = state.dump()
        raw["used"] = time.time()
        tx.put_state(branch, raw)


def _new_branch(key: str, branches: dict[str, dict]) -> str:
    if not branches:
        return key
    if len(branches) >= MAX_BRANCHES:
        return min(branches, key=lambda k: branches[k].get("used", 0))
    taken = {k for k in branches}
    return next(f"{key}{BRANCH}{n}" for n in range(1, MAX_BRANCHES + 1) if f"{key}{BRANCH}{n}" not in taken)
