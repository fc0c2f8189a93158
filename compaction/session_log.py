"""The session log: every message of every session, appended before any edit, in SQLite (WAL)
with an FTS5 index. Compaction is a view over it; the log always rebuilds the full history."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

from .prompt import Message, content_text as _text

SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    session TEXT NOT NULL,
    seq INTEGER NOT NULL,
    role TEXT NOT NULL,
    call TEXT NOT NULL DEFAULT '',   -- tool output: name and arguments of the call it answers
    body TEXT NOT NULL,              -- searchable text
    message TEXT NOT NULL,           -- the message as received (JSON)
    created REAL NOT NULL,
    UNIQUE (session, seq)
);
CREATE TABLE IF NOT EXISTS calls (
    session TEXT NOT NULL, call_id TEXT NOT NULL, name TEXT NOT NULL, arguments TEXT NOT NULL,
    PRIMARY KEY (session, call_id)
);
CREATE TABLE IF NOT EXISTS notes (
    id INTEGER PRIMARY KEY, session TEXT NOT NULL, kind TEXT NOT NULL, text TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS views (            -- per-session state of the compacted view (JSON)
    session TEXT PRIMARY KEY, state TEXT NOT NULL
);
CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts
    USING fts5(body, call, content='messages', content_rowid='id', tokenize='unicode61');
CREATE TRIGGER IF NOT EXISTS messages_ai AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts(rowid, body, call) VALUES (new.id, new.body, new.call);
END;
"""


def _args(fn: dict) -> str:
    a = fn.get("arguments", "")
    return a if isinstance(a, str) else json.dumps(a)


class SessionLog:
    """Thread-safe; one connection. Appends are one transaction each (all or nothing)."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self.lock = threading.Lock()
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")  # durable across a killed process
        self.conn.executescript(SCHEMA)

    def close(self) -> None:
        self.conn.close()

    def count(self, session: str) -> int:
        with self.lock:
            return self.conn.execute("SELECT COUNT(*) FROM messages WHERE session=?", (session,)).fetchone()[0]

    def append(self, session: str, messages: list[Message]) -> list[int]:
        """Append ``messages`` to the end of ``session``; return their ids."""
        now = time.time()
        with self.lock:
            cur = self.conn.cursor()
            cur.execute("BEGIN IMMEDIATE")
            try:
                seq = cur.execute("SELECT COALESCE(MAX(seq), -1) + 1 FROM messages WHERE session=?",
                                  (session,)).fetchone()[0]
                ids = []
                for m in messages:
                    call = ""
                    for c in m.get("tool_calls") or []:
                        fn = c.get("function", {})
                        cur.execute("INSERT OR REPLACE INTO calls VALUES (?, ?, ?, ?)",
                                    (session, c.get("id", ""), fn.get("name", ""), _args(fn)))
                    if m.get("role") == "tool":
                        row = cur.execute("SELECT name, arguments FROM calls WHERE session=? AND call_id=?",
                                          (session, m.get("tool_call_id", ""))).fetchone()
                        call = " ".join(row) if row else m.get("name", "") or ""
                    body = _text(m.get("content")) + "".join(
                        f"\n{c['function'].get('name', '')} {_args(c['function'])}" for c in m.get("tool_calls") or [])
                    cur.execute("INSERT INTO messages (session, seq, role, call, body, message, created) "
                                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                                (session, seq, m.get("role", ""), call, body, json.dumps(m), now))
                    ids.append(cur.lastrowid)
                    seq += 1
                cur.execute("COMMIT")
            except BaseException:
                cur.execute("ROLLBACK")
                raise
        return ids

    def history(self, session: str) -> list[Message]:
        """Every message of the session, in order, as received."""
        with self.lock:
            rows = self.conn.execute("SELECT message FROM messages WHERE session=? ORDER BY seq",
                                     (session,)).fetchall()
        return [json.loads(r[0]) for r in rows]

    def get_state(self, session: str) -> dict | None:
        with self.lock:
            row = self.conn.execute("SELECT state FROM views WHERE session=?", (session,)).fetchone()
        return json.loads(row[0]) if row else None

    def put_state(self, session: str, state: dict) -> None:
        with self.lock:
            self.conn.execute("INSERT OR REPLACE INTO views VALUES (?, ?)", (session, json.dumps(state)))

    def add_note(self, session: str, kind: str, text: str) -> int:
        with self.lock:
            cur = self.conn.execute("INSERT INTO notes (session, kind, text, created) VALUES (?, ?, ?, ?)",
                                    (session, kind, text, time.time()))
            return cur.lastrowid

    def notes(self, session: str) -> list[tuple[str, str]]:
        with self.lock:
            return self.conn.execute("SELECT kind, text FROM notes WHERE session=? ORDER BY id",
                                     (session,)).fetchall()
