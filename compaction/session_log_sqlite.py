"""SQLite backend of the session log: one file, WAL journal, FTS5 word index (the default)."""

from __future__ import annotations

import sqlite3
from contextlib import contextmanager
from pathlib import Path

from .session_log import SessionLog

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
CREATE TABLE IF NOT EXISTS responses (        -- Responses API, store: true (see SessionLog.put_response)
    id TEXT PRIMARY KEY, session TEXT NOT NULL, parent TEXT, turn TEXT NOT NULL, response TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts
    USING fts5(body, call, content='messages', content_rowid='id', tokenize='unicode61');
CREATE TRIGGER IF NOT EXISTS messages_ai AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts(rowid, body, call) VALUES (new.id, new.body, new.call);
END;
"""


class SQLiteLog(SessionLog):
    def __init__(self, path: str | Path):
        super().__init__()
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")  # durable across a killed process
        self.conn.executescript(SCHEMA)

    def close(self) -> None:
        self.conn.close()

    @contextmanager
    def _transaction(self):
        with self.lock:
            cur = self.conn.cursor()
            cur.execute("BEGIN IMMEDIATE")  # one writer at a time, across processes too
            try:
                yield cur.execute
                cur.execute("COMMIT")
            except BaseException:
                cur.execute("ROLLBACK")
                raise

    def _execute(self, sql, params=()):
        with self.lock:
            return self.conn.execute(sql, params).fetchall()

    def _insert_message(self, run, row, terms):
        return run("INSERT INTO messages (session, seq, role, call, body, message, created) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id", row).fetchone()[0]

    def search(self, session, query_words, all_words, limit):
        match = (" AND " if all_words else " OR ").join(f'"{w}"*' for w in query_words)
        return self._execute(
            "SELECT m.id, m.role, m.call, m.body FROM messages_fts f JOIN messages m ON m.id = f.rowid "
            "WHERE messages_fts MATCH ? AND m.session = ? "
            "ORDER BY (m.role = 'tool') DESC, bm25(messages_fts) LIMIT ?", (match, session, limit))
