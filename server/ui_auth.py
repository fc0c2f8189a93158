"""How a browser signs in to the sessions page (``/ui``): once, with its API key, for a cookie.

The cookie names the key's owner (the digest sessions are namespaced by, never the key), when it
expires, and a MAC over both with a key derived from the compaction key (replicas share that file,
so a cookie one signed is good at every replica). It is ``HttpOnly`` (no script reads it),
``SameSite=Strict`` (no other site's page sends it) and scoped to ``/ui``. A cookie is good only
while its owner is one of the server's: one signed for a key since removed from ``--api-key`` is
refused (the compaction key, and so the MAC's, outlives the key list). The API's own
``Authorization: Bearer`` / ``x-api-key`` headers work on ``/ui`` as on the API.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Collection

NAME = "agentkv_ui"
MAX_AGE_S = 12 * 3600
PATH = "/ui"


class UICookie:
    """``owners``: the owners a cookie may sign in (``edge.owners_of_keys``: the configured keys'
    digests, or ``local`` where the server takes no keys)."""

    def __init__(self, secret: bytes, owners: Collection[str], clock=time.time):
        self._key = hmac.new(secret, b"agentkv sessions page cookie", hashlib.sha256).digest()
        self._owners = frozenset(owners)
        self._clock = clock

    def _mac(self, owner: str, expires: int) -> str:
        return hmac.new(self._key, f"{owner}.{expires}".encode(), hashlib.sha256).hexdigest()[:40]

    def make(self, owner: str) -> str:
        """The cookie's value for ``owner``, good for ``MAX_AGE_S``."""
        expires = int(self._clock()) + MAX_AGE_S
        return f"{owner}.{expires}.{self._mac(owner, expires)}"

    def owner(self, value: str | None) -> str | None:
        """The owner a cookie value signs in, or None (missing, forged, expired, or its key no
        longer one of the server's)."""
        if not value or value.count(".") != 2:
            return None
        owner, expires, mac = value.split(".")
        # ASCII digits only: str.isdigit() takes "²" and the like, which int() then refuses
        if not (expires.isascii() and expires.isdigit()) or int(expires) < self._clock():
            return None
        if not (mac.isascii() and hmac.compare_digest(mac, self._mac(owner, int(expires)))):
            return None
        return owner if owner in self._owners else None

    @staticmethod
    def from_header(cookie_header: str) -> str | None:
        """This cookie's value in a ``Cookie`` header (the first, if a client sent it twice)."""
        for part in cookie_header.split(";"):
            name, _, value = part.strip().partition("=")
            if name == NAME:
                return value
        return None
