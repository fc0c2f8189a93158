"""``$AGENTKV_HOME`` kept private to the server's user: the one place agentkv sets file modes.

Two parts, both applied by the CLI before anything is written (``agentkv serve``, ``agentkv model
build``): the process umask becomes ``PRIVATE_UMASK``, so every file agentkv or its vLLM child
creates from then on is 0600 and every folder 0700, whatever the caller's umask; and
`secure_home` creates the home, or tightens an existing one (and everything already in it) to
owner-only, saying so in a log line. A home, or anything in it, owned by another user cannot be
made private: that is a `HomeError` (a CLI error naming the path).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from agentkv.compaction.log.open import is_postgres_url

from .config import agentkv_home

log = logging.getLogger(__name__)

PRIVATE_UMASK = 0o077  # files 0600, folders 0700
_GROUP_OTHER = 0o077


class HomeError(ValueError):
    """The home, or a file in it, cannot be made private to the server's user."""


def sqlite_files(target: str) -> list[Path]:
    """The files of a SQLite session log (the database, its WAL and shared-memory index);
    none for a PostgreSQL URL or ``:memory:``."""
    if is_postgres_url(target) or target == ":memory:":
        return []
    return [Path(target + suffix) for suffix in ("", "-wal", "-shm", "-journal")]


def _tree(root: Path) -> Iterator[Path]:
    """``root`` and, for a folder, everything under it; symbolic links are not followed."""
    yield root
    if root.is_dir() and not root.is_symlink():
        for folder, dirs, files in os.walk(root):
            for name in dirs + files:
                yield Path(folder, name)


def make_private(root: Path) -> list[Path]:
    """Clear the group and other permission bits of ``root`` and of everything under it (links
    are left alone: a link's target outside the home is not agentkv's). Returns what changed."""
    uid, changed = os.geteuid(), []
    for path in _tree(root):
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            continue
        if st.st_uid != uid:
            raise HomeError(f"{path} is owned by uid {st.st_uid}, not by this server's user (uid {uid}), "
                            "so it cannot be made private; chown it or set another AGENTKV_HOME")
        if st.st_mode & _GROUP_OTHER:
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~_GROUP_OTHER)
            changed.append(path)
    return changed


def secure_home(extra: Iterable[Path] = ()) -> Path:
    """Create ``$AGENTKV_HOME`` (0700, with the umask above) or make an existing one private,
    together with ``extra`` files kept elsewhere (a SQLite session log outside the home)."""
    home = agentkv_home().resolve()
    try:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise HomeError(f"cannot create AGENTKV_HOME {home}: {exc.strerror}") from None
    if not home.is_dir():
        raise HomeError(f"AGENTKV_HOME {home} is not a folder")
    owner = home.stat().st_uid
    if owner != os.geteuid():
        raise HomeError(f"AGENTKV_HOME {home} is owned by uid {owner}, not by this server's user "
                        f"(uid {os.geteuid()}), so it cannot be made private; chown it or set another AGENTKV_HOME")
    changed = make_private(home)
    for path in extra:
        path = path.resolve()
        if path.exists() and not path.is_relative_to(home):
            changed += make_private(path)
    if changed:
        log.warning("tightened %d path(s) that other users could access to owner-only (%s%s)",
                    len(changed), changed[0], ", ..." if len(changed) > 1 else "")
    return home
