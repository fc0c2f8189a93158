"""A built model directory: written atomically (never half-built) with a SHA-256 manifest."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

MANIFEST = "manifest.json"


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def is_built(out: Path) -> bool:
    return (Path(out) / MANIFEST).is_file()


def manifest(out: Path) -> dict[str, str]:
    return json.loads((Path(out) / MANIFEST).read_text())


def build_dir(out: Path, write: Callable[[Path], None], force: bool = False) -> Path:
    """Run ``write(tmp)`` into a fresh directory beside ``out``, record every file's SHA-256 in
    ``manifest.json``, then move it into place. An existing build is kept unless ``force``."""
    out = Path(out)
    if is_built(out) and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=out.parent))
    try:
        write(tmp)
        files = sorted(p for p in tmp.iterdir() if p.is_file())
        (tmp / MANIFEST).write_text(json.dumps({p.name: sha256_of(p) for p in files}, indent=2, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
