"""The session log: every message of every session, appended before any edit (``session_log``),
its SQLite and PostgreSQL backends (``sqlite``, ``postgres``), opened by ``open``, and word search
over it (``recall``)."""
