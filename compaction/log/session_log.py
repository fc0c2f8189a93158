"""The session log: every message of every session, appended before any edit, with a word index.
Compaction is a view over it; the log always rebuilds the full history.

One class holds the logic; a backend supplies the connection, the schema, transactions and the
word search: SQLite (WAL + FTS5, the default, `sqlite`) or PostgreSQL (tsvector + GIN, `postgres`,
for several replicas sharing one log). `open.open_session_log` picks one.
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Iterator

from agentkv.compaction.prompt import Message
from agentkv.compaction.prompt import content_text as _text

WORD = re.compile(r"[^\W_]+", re.UNICODE)
PUT_STATE = "INSERT INTO views VALUES (?, ?) ON CONFLICT (session) DO UPDATE SET state=excluded.state"
Exec = Callable[[str, tuple], Any]  # run one statement, return a DB-API cursor


def words(text: str) -> list[str]:
    """The searchable words of ``text``, lowercased (the same split for every backend)."""
    return [w.lower() for w in WORD.findall(text)]


def _args(fn: dict) -> str:
    a = fn.get("arguments")
    return a if isinstance(a, str) else json.dumps(a) if a is not None else ""


def _clean(text: str | None) -> str:
    return (text or "").replace("\x00", "")  # no backend indexes NUL; the JSON copy keeps it escaped


class SessionLog(ABC):
    """Thread-safe; one connection per process. Appends are one transaction each (all or nothing).
    SQL is written once with ``?`` placeholders and upserts/RETURNING both backends accept."""

    # a session's view and its forks' or branches' (``session.<token>``, ``session#N``): one key range
    # of the primary key, so the lookup costs the same with 10 or 10 million sessions stored (byte
    # order: SQLite's BINARY)
    FORKS_SQL = "SELECT session, state FROM views WHERE session >= ? AND session < ?"
    # the sessions under one owner's prefix with turns recorded, the most recently active first
    OWNED_SQL = ("SELECT session, MAX(created), COUNT(*) FROM turns WHERE session >= ? AND session < ? "
                 "GROUP BY session ORDER BY MAX(created) DESC LIMIT ?")
    # every call is local (no network, no other server to wait on): the request path may make
    # short ones on its event loop
    LOCAL = True

    def __init__(self) -> None:
        self.lock = threading.RLock()

    # -- backend -----------------------------------------------------------------------------
    @abstractmethod
    def _transaction(self) -> AbstractContextManager[Exec]:
        """Hold the lock, begin; yield an executor; commit (roll back on error)."""

    @abstractmethod
    def _execute(self, sql: str, params: tuple = ()) -> Any:
        """One statement on its own (autocommit), under the lock; returns the fetched rows."""

    @abstractmethod
    def _insert_message(self, run: Exec, row: tuple, terms: str) -> int:
        """Insert (session, seq, role, call, body, message, created) and index it; return its id."""

    @abstractmethod
    def search(self, session: str, query_words: list[str], all_words: bool, limit: int) -> list[tuple]:
        """(id, role, call, body) of messages of ``session`` holding every word of ``query_words``
        (any word when not ``all_words``), each word also as a prefix; tool outputs first, then rank."""

    def _lock_session(self, run: Exec, session: str) -> None:  # noqa: B027 (a no-op where a backend needs none)
        """Serialize appends to one session across processes (where the backend needs it)."""

    @abstractmethod
    def close(self) -> None: ...

    # -- the log -----------------------------------------------------------------------------
    def count(self, session: str) -> int:
        return self._execute("SELECT COUNT(*) FROM messages WHERE session=?", (session,))[0][0]

    def append(self, session: str, messages: list[Message]) -> list[int]:
        """Append ``messages`` to the end of ``session``; return their ids (one transaction)."""
        with self.transaction(session) as tx:
            return tx.append(session, messages)

    @contextmanager
    def transaction(self, lock: str) -> Iterator[LogTransaction]:
        """One transaction holding the session lock ``lock`` (across processes and replicas): what
        is read in it and what is written in it are one step, so two requests on one session can
        neither interleave nor both append the same messages."""
        with self._transaction() as run:
            self._lock_session(run, lock)
            yield LogTransaction(self, run)

    def _append(self, run: Exec, session: str, messages: list[Message]) -> list[int]:
        self._lock_session(run, session)
        now = time.time()
        seq = run("SELECT COALESCE(MAX(seq), -1) + 1 FROM messages WHERE session=?", (session,)).fetchone()[0]
        ids = []
        for m in messages:
            call = ""
            for c in m.get("tool_calls") or []:
                fn = c.get("function", {})
                run("INSERT INTO calls VALUES (?, ?, ?, ?) ON CONFLICT (session, call_id) "
                    "DO UPDATE SET name=excluded.name, arguments=excluded.arguments",
                    (session, _clean(c.get("id")), _clean(fn.get("name")), _clean(_args(fn))))
            if m.get("role") == "tool":
                row = run("SELECT name, arguments FROM calls WHERE session=? AND call_id=?",
                          (session, _clean(m.get("tool_call_id")))).fetchone()
                call = " ".join(row) if row else m.get("name") or ""
            body = _clean(_text(m.get("content")) + "".join(
                f"\n{c['function'].get('name') or ''} {_args(c['function'])}" for c in m.get("tool_calls") or []))
            call = _clean(call)
            row = (session, seq, _clean(m.get("role", "")), call, body, json.dumps(m), now)
            ids.append(self._insert_message(run, row, " ".join(words(body + " " + call))))
            seq += 1
        return ids

    def history(self, session: str, offset: int = 0, limit: int | None = None) -> list[Message]:
        """Every message of the session (or ``limit`` of them from ``offset``), in order, as received."""
        sql = "SELECT message FROM messages WHERE session=? ORDER BY seq"
        params: tuple[str | int, ...] = (session,)
        if limit is not None or offset:
            sql, params = sql + " LIMIT ? OFFSET ?", (session, 2**63 - 1 if limit is None else limit, offset)
        rows = self._execute(sql, params)
        return [json.loads(r[0]) for r in rows]

    def get_state(self, session: str) -> dict | None:
        rows = self._execute("SELECT state FROM views WHERE session=?", (session,))
        return json.loads(rows[0][0]) if rows else None

    def put_state(self, session: str, state: dict) -> None:
        self._execute(PUT_STATE, (session, json.dumps(state)))

    def states_like(self, session: str, sep: str = ".") -> dict[str, dict]:
        """The view states of ``session`` and of the ones named ``session<sep>...`` (its forks or
        branches, see server.pipeline.sessions)."""
        return _states_like(lambda sql, p: self._execute(sql, p), self.FORKS_SQL, session, sep)

    def add_note(self, session: str, kind: str, text: str) -> int:
        return self._execute("INSERT INTO notes (session, kind, text, created) VALUES (?, ?, ?, ?) RETURNING id",
                             (session, kind, _clean(text), time.time()))[0][0]

    def notes(self, session: str) -> list[tuple[str, str]]:
        rows = self._execute("SELECT kind, text FROM notes WHERE session=? ORDER BY id", (session,))
        return [tuple(r) for r in rows]

    # -- stored responses (the Responses API's `store: true`) --------------------------------
    def put_response(self, response_id: str, session: str, parent: str | None, turn: list[Message],
                     response: dict) -> None:
        """Keep a response: ``turn`` holds the messages it added to its conversation (its new input,
        then its output), ``parent`` the response it continued; a chain of them is the conversation."""
        self._execute("INSERT INTO responses (id, session, parent, turn, response, created) VALUES (?, ?, ?, ?, ?, ?)",
                      (response_id, session, parent, json.dumps(turn), json.dumps(response), time.time()))

    def get_response(self, response_id: str) -> tuple[str, dict] | None:
        """(session, the response object) of a stored response."""
        rows = self._execute("SELECT session, response FROM responses WHERE id=?", (response_id,))
        return (rows[0][0], json.loads(rows[0][1])) if rows else None

    def response_record(self, response_id: str) -> tuple[str, dict, float, bool] | None:
        """(session, the response object, when it was stored, whether a later response continues it)
        of a stored response."""
        rows = self._execute("SELECT r.session, r.response, r.created, "
                             "EXISTS (SELECT 1 FROM responses c WHERE c.parent = r.id) "
                             "FROM responses r WHERE r.id = ?", (response_id,))
        return (rows[0][0], json.loads(rows[0][1]), float(rows[0][2]), bool(rows[0][3])) if rows else None

    def response_conversation(self, response_id: str) -> list[Message]:
        """The conversation through a stored response: the turns of its chain, oldest first (one query)."""
        rows = self._execute(
            "WITH RECURSIVE chain(id, parent, turn, depth) AS ("
            " SELECT id, parent, turn, 0 FROM responses WHERE id = ?"
            " UNION ALL SELECT r.id, r.parent, r.turn, c.depth + 1 FROM responses r JOIN chain c ON r.id = c.parent"
            ") SELECT turn FROM chain ORDER BY depth DESC", (response_id,))
        return [m for (turn,) in rows for m in json.loads(turn)]

    def is_continued(self, response_id: str) -> bool:
        """Whether a later response continues this stored one."""
        return bool(self._execute("SELECT EXISTS (SELECT 1 FROM responses WHERE parent = ?)", (response_id,))[0][0])

    # -- turns: what each engine turn of a session did (the sessions page reads them) ------------
    def add_turn(self, session: str, branch: str, record: dict) -> None:
        """Keep what one turn did (sizes, usage, the edits and what KV reuse did), JSON."""
        self._execute("INSERT INTO turns (session, branch, record, created) VALUES (?, ?, ?, ?)",
                      (session, branch, json.dumps(record), time.time()))

    def turns(self, session: str, limit: int = 1000) -> list[tuple[str, dict, float]]:
        """(branch, record, when) of the session's turns, oldest first (its last ``limit``)."""
        rows = self._execute("SELECT branch, record, created FROM turns WHERE session = ? ORDER BY id DESC LIMIT ?",
                             (session, limit))
        return [(r[0], json.loads(r[1]), float(r[2])) for r in reversed(rows)]

    def sessions_under(self, prefix: str, limit: int = 200) -> list[tuple[str, float, int]]:
        """(session, last turn's time, turns) of the sessions whose key starts with ``prefix``
        (one owner's: ``owner/``), the most recently active first."""
        assert prefix.endswith("/")   # the key range [owner/, owner0) holds exactly the owner's keys
        rows = self._execute(self.OWNED_SQL, (prefix, prefix[:-1] + "0", limit))
        return [(r[0], float(r[1]), int(r[2])) for r in rows]

    # -- claims: work that one process at a time may do, whichever replica it runs on ----------
    def claim(self, name: str, ttl_s: float) -> str | None:
        """Take the claim ``name`` for ``ttl_s`` seconds: its holder token, or None while another
        holder's has not expired. One statement: of every process sharing this log, one wins."""
        now, holder = time.time(), secrets.token_hex(8)
        won = self._execute(
            "INSERT INTO claims (name, holder, expires) VALUES (?, ?, ?) ON CONFLICT (name) DO UPDATE "
            "SET holder = excluded.holder, expires = excluded.expires WHERE claims.expires < ? RETURNING name",
            (name, holder, now + ttl_s, now))
        return holder if won else None

    def release(self, name: str, holder: str) -> None:
        """Let go of a claim this holder still has (one that expired and was taken since is left)."""
        self._execute("DELETE FROM claims WHERE name = ? AND holder = ?", (name, holder))


def _states_like(run: Callable, sql: str, session: str, sep: str) -> dict[str, dict]:
    assert sep < "/", sep   # the key range [session, session + "/") holds session<sep>*; the filter is exact
    rows = run(sql, (session, session + "/"))
    rows = rows.fetchall() if hasattr(rows, "fetchall") else rows
    return {r[0]: json.loads(r[1]) for r in rows if r[0] == session or r[0].startswith(session + sep)}


class LogTransaction:
    """What can be done inside ``SessionLog.transaction``: read view states, append, write state."""

    def __init__(self, log: SessionLog, run: Exec):
        self._log, self._run = log, run

    def get_state(self, session: str) -> dict | None:
        row = self._run("SELECT state FROM views WHERE session=?", (session,)).fetchone()
        return json.loads(row[0]) if row else None

    def states_like(self, session: str, sep: str = ".") -> dict[str, dict]:
        return _states_like(self._run, self._log.FORKS_SQL, session, sep)

    def append(self, session: str, messages: list[Message]) -> list[int]:
        return self._log._append(self._run, session, messages) if messages else []

    def lock(self, name: str) -> None:
        """Also hold ``name``'s lock until the transaction ends."""
        self._log._lock_session(self._run, name)

    def put_state(self, session: str, state: dict) -> None:
        self._run(PUT_STATE, (session, json.dumps(state)))
