"""The Responses API's ``compaction`` item: the messages a compacted conversation stands for (agentkv's
summary message, then any part kept word for word), sealed so that only this server reads it back.

``encrypted_content`` is ``akv1.<payload>.<tag>``: the payload is base64url(zlib(JSON {"owner",
"messages"})), the tag base64url(HMAC-SHA256(key, "akv1." + payload)). It is authenticated, not
encrypted: it holds the caller's own conversation, so secrecy buys nothing, while the tag makes an
altered or forged item a 400 and binds the item to the API key it was made for. The key is 32 bytes
in ``--compaction-key-file`` (default ``$AGENTKV_HOME/compaction.key``; raw, or 64 hex digits as
``openssl rand -hex 32`` writes them), made owner-only when missing, so items outlive restarts;
replicas that share sessions must share that file (a Kubernetes Secret, say).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
import tempfile
import time
import uuid
import zlib
from pathlib import Path

from agentkv.compaction.prompt import Message
from agentkv.server.config import agentkv_home
from agentkv.server.errors import APIError

VERSION = "akv1"
KEY_FILE = "compaction.key"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class KeyFileError(RuntimeError):
    """The compaction key file cannot be read, made, or does not hold a key."""


def _parse_key(raw: bytes, path: Path) -> bytes:
    if len(raw) == 32:
        return raw
    text = raw.strip()
    if len(text) == 64:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    raise KeyFileError(f"{path} must hold 32 bytes, or 64 hex digits (delete it to make a new key)")


def load_key(home: Path | None = None, path: Path | str | None = None) -> bytes:
    """The server's key from ``path`` (default ``home/compaction.key``), created owner-only when
    missing. Concurrent first uses (threads, processes, replicas on one volume) agree, and none can
    read a half-written key: the key is written to a private temporary file first, which is then
    linked into place only if no key is there yet (an atomic step); the loser reads the winner's."""
    path = Path(path) if path else (home or agentkv_home()) / KEY_FILE
    try:
        return _load(path)
    except OSError as exc:
        raise KeyFileError(f"{path}: {exc.strerror or exc}") from None


def _load(path: Path) -> bytes:
    if path.exists():
        return _read(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(32)
    fd, tmp = tempfile.mkstemp(prefix=".compaction-key-", dir=path.parent)   # mode 0600
    try:
        _write_durably(fd, key)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return _read(path)
        except OSError:   # a file system without hard links: created exclusively, written at once
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                return _read(path)
            _write_durably(fd, key)
    finally:
        os.unlink(tmp)
    _sync_dir(path.parent)
    return key


def _write_durably(fd: int, data: bytes) -> None:
    """Write ``data`` to the open file ``fd``, on disk when this returns; closes it."""
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _read(path: Path) -> bytes:
    """The key in ``path``; one being written by another process right now (the exclusive-create
    fallback) is read again for up to a second."""
    deadline = time.monotonic() + 1.0
    while True:
        raw = path.read_bytes()
        if raw or time.monotonic() > deadline:
            return _parse_key(raw, path)
        time.sleep(0.02)


def _sync_dir(folder: Path) -> None:
    """The key's name, durable (the file's bytes are already)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class CompactionSeal:
    """Makes and opens compaction items with one key."""

    def __init__(self, key: bytes):
        self.key = key

    def _tag(self, payload: str) -> str:
        return _b64(hmac.new(self.key, f"{VERSION}.{payload}".encode(), hashlib.sha256).digest())

    def item(self, owner: str, messages: list[Message]) -> dict:
        """A ``compaction`` output item standing for ``messages``."""
        raw = json.dumps({"owner": owner, "messages": messages}, separators=(",", ":")).encode()
        payload = _b64(zlib.compress(raw, 6))
        return {"id": f"cmp_{uuid.uuid4().hex}", "type": "compaction",
                "encrypted_content": f"{VERSION}.{payload}.{self._tag(payload)}"}

    def sign_text(self, owner: str, text: str) -> str:
        """The ``signature`` of an Anthropic ``compaction`` block holding ``text`` (compaction on
        demand): the same sealed form, recording the owner and the text's digest."""
        payload = _b64(json.dumps({"owner": owner, "sha256": hashlib.sha256(text.encode()).hexdigest()},
                                  separators=(",", ":")).encode())
        return f"{VERSION}.{payload}.{self._tag(payload)}"

    def _payload(self, sealed: object) -> str | None:
        """The payload of ``akv1.<payload>.<tag>`` made with this key, or None for anything else
        (altered, forged, not a string, non-ASCII included)."""
        parts = sealed.split(".") if isinstance(sealed, str) else []
        if len(parts) != 3 or parts[0] != VERSION or \
                not hmac.compare_digest(parts[2].encode(errors="replace"), self._tag(parts[1]).encode()):
            return None
        return parts[1]

    def check_text(self, owner: str, text: str | None, signature: str) -> str | None:
        """None if ``signature`` was made here, for ``owner``, over ``text``; else Anthropic's error
        code: ``compaction_signature_invalid`` (altered, forged, another key's) or
        ``compaction_content_mismatch`` (a genuine signature, other text)."""
        payload = self._payload(signature)
        if payload is None:
            return "compaction_signature_invalid"
        try:
            data = json.loads(_unb64(payload))
        except (ValueError, binascii.Error):
            return "compaction_signature_invalid"
        if not isinstance(data, dict) or data.get("owner") != owner:
            return "compaction_signature_invalid"
        if not isinstance(text, (str, type(None))) or \
                data.get("sha256") != hashlib.sha256((text or "").encode()).hexdigest():
            return "compaction_content_mismatch"
        return None

    def open(self, owner: str, item: dict, where: str) -> list[Message]:
        """The messages an item stands for; 400 naming ``where.encrypted_content`` when the item
        was not made by this server for this caller, or was altered."""
        param = f"{where}.encrypted_content"
        payload = self._payload(item.get("encrypted_content"))
        if payload is None:
            raise APIError(400, "the compaction item was not made by this server or was altered",
                           param=param, code="invalid_encrypted_content")
        try:
            data = json.loads(zlib.decompress(_unb64(payload)))
        except (ValueError, zlib.error, binascii.Error):  # a valid tag on a bad payload: a key leak or a bug
            raise APIError(400, "the compaction item cannot be read", param=param,
                           code="invalid_encrypted_content") from None
        if data.get("owner") != owner:
            raise APIError(400, "the compaction item was made for another API key", param=param,
                           code="invalid_encrypted_content")
        return data["messages"]
