"""The prefix-cache salt of every engine request, set by the server alone.

vLLM's prefix cache hashes a request's blocks together with its ``cache_salt``: requests share
cached blocks only where their salts are equal. The server gives every request one of two salts:

- **exact**: derived from the caller's API key and the client's own ``cache_salt`` if it sent one.
  Requests of one key (and one client salt) share prefixes; two keys never do, so no key can time
  another's prompts (``--shared-prefix-cache``: one tenant, every key shares; off by default).
- **approximate**: for the requests of a conversation branch whose K/V a ``shift`` or ``blend``
  load made (its view has clearing edits in force and it runs with the connector). Derived from the
  branch as well: blocks that hold moved K/V are cached under it, and a request served exactly
  (``recompute``, another conversation, another key) never uses it, so it can never read them.

The key is this process's own: salts, like the prefix cache, live as long as the engine.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

_KEY = secrets.token_bytes(32)


def _salt(*parts: str) -> str:
    return hmac.new(_KEY, "\0".join(parts).encode(), hashlib.sha256).hexdigest()[:32]


def exact(owner: str, client_salt: str | None, shared_across_keys: bool = False) -> str:
    """The salt of requests whose K/V vLLM computes itself."""
    return _salt("exact", "" if shared_across_keys else owner, client_salt or "")


def approximate(branch: str, client_salt: str | None) -> str:
    """The salt of one conversation branch's requests once moved K/V are in its prompt
    (``branch``: its storage key, which names the owner)."""
    return _salt("approximate", branch, client_salt or "")
