"""Opening the session log: a ``postgresql://`` URL opens PostgreSQL, anything else SQLite."""

from __future__ import annotations

from pathlib import Path

from .session_log import SessionLog


def is_postgres_url(target: str) -> bool:
    return target.startswith(("postgresql://", "postgres://"))


def open_session_log(target: str | Path) -> SessionLog:
    """``postgresql://...`` opens PostgreSQL; anything else is a SQLite file path (or ``:memory:``)."""
    target = str(target)
    if is_postgres_url(target):
        from .postgres import PostgresLog

        return PostgresLog(target)
    from .sqlite import SQLiteLog

    return SQLiteLog(target)
