"""Session log (SQLite WAL + FTS5, and PostgreSQL) and recall: planted facts survive clearing and summaries;
a killed writer loses nothing it committed."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import time

from agentkv.compaction.clearing import clear_tool_uses
from agentkv.compaction.config import ClearToolUses, Compact
from agentkv.compaction.log.open import open_session_log
from agentkv.compaction.log.recall import format_hits, recall
from agentkv.compaction.summarize import summarize


def diag_session() -> list[dict]:
    """Six service reports, one fact each among noise (the first seed's setup, small)."""
    msgs = [{"role": "system", "content": "agent"}, {"role": "user", "content": "Run the diagnostics."}]
    facts = {"media": "timeout_ms = 1050", "auth": "port = 8443", "billing": "owner = dana",
             "search": "region = eu-west-1", "queue": "error_codes = E2033 E3201", "storage": "retries = 7"}
    for i, (svc, fact) in enumerate(facts.items()):
        noise = [f"{svc} check {j}: ok latency {j * 3} ms" for j in range(40)]
        noise.insert(17, fact)
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function",
             "function": {"name": "bash", "arguments": json.dumps({"cmd": f"python diag.py {svc}"})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"== {svc} ==\n" + "\n".join(noise)})
    return msgs


class FixedNote:
    def complete(self, messages, max_tokens):
        return "Diagnostics were run on six services."


def test_recall_finds_planted_facts_after_clearing_and_summary(renderer, log_target):
    log = open_session_log(log_target)
    msgs = diag_session()
    log.append("s1", msgs)                                 # logged before any edit
    cleared = clear_tool_uses(msgs, renderer, ClearToolUses(trigger=0, keep=0))
    assert cleared.cleared_tool_uses == 6
    view = summarize(cleared.messages, renderer, Compact(trigger=0, keep_recent_tokens=0), FixedNote())
    assert "1050" not in json.dumps(view.messages)         # gone from the context...
    assert log.history("s1") == msgs                       # ...not from the log
    hits = recall(log, "s1", "media timeout")               # words matched against the call too
    assert hits[0].role == "tool" and "timeout_ms = 1050" in hits[0].lines
    assert "diag.py media" in hits[0].call
    assert any("E2033" in line for h in recall(log, "s1", "queue error codes") for line in h.lines)
    assert "port = 8443" in format_hits(recall(log, "s1", "auth port"))


def test_recall_is_per_session_and_ranks_tool_outputs_first(log_target):
    log = open_session_log(log_target)
    log.append("a", [{"role": "user", "content": "what is the gateway port?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "x", "type": "function", "function": {"name": "cat", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "x", "content": "gateway port = 9000"}])
    log.append("b", [{"role": "tool", "tool_call_id": "y", "content": "gateway port = 1"}])
    hits = recall(log, "a", "gateway port")
    assert [h.role for h in hits] == ["tool", "user"]
    assert all("= 1" not in line for h in hits for line in h.lines)
    assert recall(log, "nobody", "gateway") == [] and recall(log, "a", "!!") == []


def test_history_pages(log_target):
    log = open_session_log(log_target)
    msgs = [{"role": "user", "content": f"m{i}"} for i in range(7)]
    log.append("s", msgs)
    assert log.history("s") == msgs and log.history("s", 2, 3) == msgs[2:5]
    assert log.history("s", 5) == msgs[5:] and log.history("s", 9, 2) == []


def test_notes_are_stored_per_session(log_target):
    log = open_session_log(log_target)
    log.add_note("s", "decision", "use retries = 7")
    log.add_note("s", "rejected", "raising the timeout alone")
    log.add_note("t", "progress", "other")
    assert log.notes("s") == [("decision", "use retries = 7"), ("rejected", "raising the timeout alone")]


WRITER = """
import sys
from agentkv.compaction.log.open import open_session_log
log = open_session_log(sys.argv[1])
i = 0
while True:
    log.append("s", [{"role": "user", "content": f"message {i} " + "x" * 2000}])
    print(i, flush=True)
    i += 1
"""


def test_log_survives_a_killed_writer(log_target):
    db = log_target
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, text=True)
    acked = []
    deadline = time.monotonic() + 60
    while len(acked) < 200 and time.monotonic() < deadline:
        acked.append(int(proc.stdout.readline()))
    proc.send_signal(signal.SIGKILL)                       # mid-write: it never stops appending
    proc.wait()
    assert len(acked) >= 200
    if "://" not in db:
        conn = sqlite3.connect(db)
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        conn.close()
    history = open_session_log(db).history("s")
    assert len(history) >= len(acked)                      # every acknowledged message is there
    assert [m["content"].split()[1] for m in history[:len(acked)]] == [str(i) for i in acked]


def test_postgres_log_reconnects_after_the_server_drops_it(postgres_db):
    import psycopg

    log = open_session_log(postgres_db)
    log.append("s", [{"role": "user", "content": "before"}])
    pid = log.conn.info.backend_pid
    with psycopg.connect(postgres_db, autocommit=True) as admin:   # as a PostgreSQL restart would
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
    try:
        log.count("s")                                 # this one fails (the server answers 503)...
    except psycopg.OperationalError:
        pass
    log.append("s", [{"role": "user", "content": "after"}])   # ...and the log is back on the next
    assert [m["content"] for m in log.history("s")] == ["before", "after"]
    assert log.conn.info.backend_pid != pid


def test_sqlite_checkpoints_run_off_the_request_path(tmp_path, monkeypatch):
    """Requests' commits never checkpoint (the automatic checkpoint is off); a thread of the log's
    own copies the WAL into the database file, so it does not grow without bound."""
    from agentkv.compaction.log.sqlite import SQLiteLog

    monkeypatch.setattr(SQLiteLog, "CHECKPOINT_S", 0.05)
    db = tmp_path / "log.db"
    log = SQLiteLog(db)
    assert log.conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 0
    size = db.stat().st_size
    for i in range(50):
        log.append("s", [{"role": "tool", "tool_call_id": str(i), "content": f"line {i} " + "x" * 4000}])
    deadline = time.monotonic() + 30
    while db.stat().st_size <= size + 100_000 and time.monotonic() < deadline:   # the WAL's pages, copied back
        time.sleep(0.05)
    assert db.stat().st_size > size + 100_000
    log.close()
    assert not log._checkpointer.is_alive()
    assert len(open_session_log(db).history("s")) == 50
