"""PostgreSQL backend of the session log (``--session-db postgresql://...``): several replicas
can share one log. Words are indexed as a ``tsvector`` (config ``simple``, GIN index) built from
the same word split SQLite's FTS5 uses, so recall finds the same messages on both.

The database must use UTF-8. Appends to one session take a transaction-scoped advisory lock, so
two replicas appending to the same session never interleave sequence numbers.
"""

from __future__ import annotations

from contextlib import contextmanager

import psycopg

from .session_log import SessionLog

SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    id BIGSERIAL PRIMARY KEY,
    session TEXT NOT NULL,
    seq INTEGER NOT NULL,
    role TEXT NOT NULL,
    call TEXT NOT NULL DEFAULT '',
    body TEXT NOT NULL,
    message TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL,
    terms TSVECTOR NOT NULL,
    UNIQUE (session, seq)
);
CREATE INDEX IF NOT EXISTS messages_terms ON messages USING GIN (terms);
CREATE TABLE IF NOT EXISTS calls (
    session TEXT NOT NULL, call_id TEXT NOT NULL, name TEXT NOT NULL, arguments TEXT NOT NULL,
    PRIMARY KEY (session, call_id)
);
CREATE TABLE IF NOT EXISTS notes (
    id BIGSERIAL PRIMARY KEY, session TEXT NOT NULL, kind TEXT NOT NULL, text TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS notes_session ON notes (session);
CREATE TABLE IF NOT EXISTS views (session TEXT PRIMARY KEY, state TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS views_session_bytes ON views ((session COLLATE "C"));
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY, session TEXT NOT NULL, parent TEXT, turn TEXT NOT NULL, response TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_parent ON responses (parent);
CREATE TABLE IF NOT EXISTS claims (name TEXT PRIMARY KEY, holder TEXT NOT NULL, expires DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS turns (
    id BIGSERIAL PRIMARY KEY, session TEXT NOT NULL, branch TEXT NOT NULL, record TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS turns_session ON turns ((session COLLATE "C"), id);
"""
MAX_TERMS_CHARS = 256 * 1024
SCHEMA_LOCK = 0x6167656E746B76  # "agentkv": replicas starting together create the schema once


def _pg(sql: str) -> str:
    return sql.replace("?", "%s")


class PostgresLog(SessionLog):
    # byte order whatever the database's collation (a locale's order is not a prefix's key range),
    # served by the views_session_bytes index
    FORKS_SQL = 'SELECT session, state FROM views WHERE session COLLATE "C" >= ? AND session COLLATE "C" < ?'
    OWNED_SQL = ('SELECT session, MAX(created), COUNT(*) FROM turns WHERE session COLLATE "C" >= ? '
                 'AND session COLLATE "C" < ? GROUP BY session ORDER BY MAX(created) DESC LIMIT ?')
    LOCAL = False   # a round trip to the database server: never on the event loop

    def __init__(self, url: str):
        super().__init__()
        self.url = url
        self.conn = self._connect()
        with self._transaction() as run:
            run("SELECT pg_advisory_xact_lock(?)", (SCHEMA_LOCK,))
            for stmt in filter(str.strip, SCHEMA.split(";")):
                run(stmt, ())

    def _connect(self) -> psycopg.Connection:
        conn = psycopg.connect(self.url, autocommit=True, connect_timeout=10)
        row = conn.execute("SHOW server_encoding").fetchone()
        assert row is not None   # SHOW always returns one row
        enc = row[0]
        if enc.upper() not in ("UTF8", "UTF-8"):
            conn.close()
            raise ValueError(f"the session log database must use UTF8 encoding, not {enc}")
        return conn

    def _ensure(self) -> None:
        """Reconnect once when the server dropped the connection (a PostgreSQL restart)."""
        if self.conn.closed or self.conn.broken:
            self.conn = self._connect()

    def close(self) -> None:
        self.conn.close()

    @contextmanager
    def _transaction(self):
        with self.lock:
            self._ensure()
            with self.conn.transaction():
                yield lambda sql, params: self.conn.execute(_pg(sql), params)

    def _execute(self, sql, params=()):
        with self.lock:
            self._ensure()
            cur = self.conn.execute(_pg(sql), params)
            return cur.fetchall() if cur.description else []

    def _lock_session(self, run, session):
        run("SELECT pg_advisory_xact_lock(hashtextextended(?, 0))", (session,))

    def _insert_message(self, run, row, terms):
        # A tsvector holds at most 1 MiB: index each distinct word once, the first ones first.
        terms = " ".join(dict.fromkeys(terms.split()))[:MAX_TERMS_CHARS]
        return run("INSERT INTO messages (session, seq, role, call, body, message, created, terms) "
                   "VALUES (?, ?, ?, ?, ?, ?, ?, strip(to_tsvector('simple', ?))) RETURNING id",
                   (*row, terms)).fetchone()[0]

    def search(self, session, query_words, all_words, limit):
        query = (" & " if all_words else " | ").join(f"{w}:*" for w in query_words)
        return self._execute(
            "SELECT id, role, call, body FROM messages, to_tsquery('simple', ?) q "
            "WHERE session = ? AND terms @@ q "
            "ORDER BY (role = 'tool') DESC, id DESC LIMIT ?", (query, session, limit))
