"""Sessions: who a request belongs to, its log, and the compacted view the engine is sent.

The client sends its whole conversation every time. The session keeps, in the log database,
the keys of the conversation it has seen and the edits applied so far (replaced messages and the
summary), so the view stays the same from one request to the next (the prefix cache survives)
and changes only when a policy edit fires. Every new message is appended to the log before any
edit is applied; the log is never rewritten.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

from ..compaction.prompt import Message, message_key
from ..compaction.session_log import SessionLog
from .errors import APIError

# no "/" or "\\" and not only dots: an id is never a path, and could not be made one
SESSION_ID = re.compile(r"^(?!\.+$)[A-Za-z0-9._:@-]{1,128}$")


def session_key(owner: str, session_id: str | None, messages: list[Message]) -> tuple[str, str]:
    """(storage key, public id). Without an id, one is derived from the conversation's first
    messages (system prompt and first user message), which stay the same as it grows."""
    if session_id is None:
        first = [m for m in messages if m.get("role") in ("system", "developer")][:1] + \
                [m for m in messages if m.get("role") == "user"][:1]
        session_id = "auto-" + hashlib.sha256(json.dumps(first, sort_keys=True).encode()).hexdigest()[:24]
    elif not SESSION_ID.match(session_id):
        raise APIError(400, "session id must be 1-128 characters of letters, digits and ._:@- (not only dots)",
                       param="session_id")
    return f"{owner}/{session_id}", session_id


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


class Sessions:
    """The session log plus per-session view state. Methods are blocking (SQLite)."""

    def __init__(self, log: SessionLog):
        self.log = log

    def sync(self, key: str, messages: list[Message]) -> ViewState:
        """Append the messages the log has not seen (before any edit) and return the view state."""
        state = ViewState.load(self.log.get_state(key))
        keys = [message_key(m) for m in messages]
        common = 0
        while common < min(len(keys), len(state.keys)) and keys[common] == state.keys[common]:
            common += 1
        if common < len(state.keys):
            state.forget_from(common)
        state.keys = keys
        if keys[common:]:  # the new messages and the state that records them: one transaction
            self.log.append(key, messages[common:], state=state.dump())
        else:
            self.log.put_state(key, state.dump())
        return state

    def save(self, key: str, state: ViewState) -> None:
        self.log.put_state(key, state.dump())
