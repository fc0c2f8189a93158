"""Ids of what the server makes (messages, responses, output items): 32 hex digits after a prefix.

Behind the router (``deploy/router/haproxy.cfg``) a request carries ``X-AgentKV-Route``, the 8 hex
digits the router placed the conversation by; an id made for that request begins with them. A
message-thread continue or a ``previous_response_id`` request names such an id, and the router
places it by those digits: the whole chain stays on the replica of its first request, though the
later requests carry neither a session id nor the conversation's prefix. The digits only route:
any value a client sends is harmless (the rest of the id is 96 random bits).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from contextvars import ContextVar

HEADER = "x-agentkv-route"
_TOKEN = re.compile(r"[0-9a-f]{8}")
_route: ContextVar[str | None] = ContextVar("agentkv_route", default=None)


def take_route(headers: Mapping[str, str]) -> None:
    """Ids made for this request (the current task and the ones it starts) begin with the router's
    token, when it sent a valid one."""
    token = (headers.get(HEADER) or "").lower()
    _route.set(token if _TOKEN.fullmatch(token) else None)


def new_id(prefix: str) -> str:
    token = _route.get()
    return f"{prefix}_{token}{secrets.token_hex(12)}" if token else f"{prefix}_{secrets.token_hex(16)}"
