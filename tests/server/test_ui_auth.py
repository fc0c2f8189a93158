"""The sessions page's cookie (server/ui_auth.py): forged, expired, malformed and revoked cookies
sign nobody in, and the edge sends such a browser to ``/ui/login``."""

from __future__ import annotations

import asyncio

import pytest

from agentkv.server.edge import Edge, owner_of_key, owners_of_keys
from agentkv.server.ui_auth import MAX_AGE_S, NAME, UICookie

SECRET = b"s" * 32
KEYS = ("key-one", "key-two")


def owner(key: str) -> str:
    found = owner_of_key(KEYS + (key,), f"Bearer {key}", "")
    assert found is not None
    return found


def test_a_cookie_signs_in_its_owner_until_it_expires():
    now = [1_000_000.0]
    cookie = UICookie(SECRET, owners_of_keys(KEYS), clock=lambda: now[0])
    value = cookie.make(owner("key-one"))
    assert cookie.owner(value) == owner("key-one")
    now[0] += MAX_AGE_S + 1
    assert cookie.owner(value) is None


def test_a_cookie_for_a_key_no_longer_configured_is_refused():
    """The MAC's key (from the compaction key) outlives ``--api-key``: a cookie signed while a key
    was configured must stop working once the server no longer takes that key."""
    before = UICookie(SECRET, owners_of_keys(KEYS))
    value = before.make(owner("key-two"))
    assert before.owner(value) == owner("key-two")
    after = UICookie(SECRET, owners_of_keys(("key-one",)))          # key-two revoked, same secret
    assert after.owner(value) is None
    assert after.owner(after.make(owner("key-one"))) == owner("key-one")
    keyless = UICookie(SECRET, owners_of_keys(()))                   # no keys: only "local"
    assert keyless.owner(value) is None
    assert keyless.owner(keyless.make("local")) == "local"


def test_owners_of_keys_are_what_owner_of_key_makes():
    assert owners_of_keys(KEYS) == {owner_of_key(KEYS, f"Bearer {k}", "") for k in KEYS}
    assert owners_of_keys(()) == {"local"} == {owner_of_key((), "", "")}


@pytest.mark.parametrize("expires", ["²", "١٢٣٤٥٦٧٨٩٠", "9" * 20 + "²", "-1", "", "1e9"])
def test_a_forged_expiry_is_refused_not_an_error(expires):
    """``"²".isdigit()`` is true and ``int("²")`` raises: a cookie so forged was a 500."""
    cookie = UICookie(SECRET, owners_of_keys(KEYS))
    assert cookie.owner(f"{owner('key-one')}.{expires}.{'0' * 40}") is None


@pytest.mark.parametrize("value", [None, "", "a.b", "a.b.c.d", "x.99999999999.é", "ö.99999999999.abc"])
def test_malformed_cookies_are_refused(value):
    assert UICookie(SECRET, owners_of_keys(KEYS)).owner(value) is None


def _get(app, path: str, cookie: str) -> int:
    """The status ``app`` answers a GET of ``path`` with this cookie (in process)."""
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "headers": [(b"cookie", f"{NAME}={cookie}".encode())]}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"]


def test_the_edge_sends_a_revoked_cookie_to_sign_in():
    async def page(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"sessions"})

    minted = UICookie(SECRET, owners_of_keys(KEYS)).make(owner("key-two"))
    still = Edge(page, 1 << 20, keys=KEYS, ui=UICookie(SECRET, owners_of_keys(KEYS)))
    revoked = Edge(page, 1 << 20, keys=("key-one",), ui=UICookie(SECRET, owners_of_keys(("key-one",))))
    assert _get(still, "/ui", minted) == 200
    assert _get(revoked, "/ui", minted) == 303                   # to /ui/login
    assert _get(revoked, "/ui/api/sessions", minted) == 401
