"""agentkv's own request fields, beside each API's, and the KV reuse modes: declared once.

Every API's request model takes ``AgentKVFields`` (``context_management`` is declared per API: it
is also Anthropic's and OpenAI's own field, in their shapes); the server's config and the
benchmarks take the same ``KVMode`` and ``BlendStrategy``. ``SERVER_ONLY`` names the engine
fields that only the server sets: a client that sends one is refused (``refuse_server_only``).
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError

KVMode = Literal["recompute", "shift", "blend"]
KV_MODES: tuple[str, ...] = get_args(KVMode)
BlendStrategy = Literal["tail", "cuts", "deviation"]
BLEND_STRATEGIES: tuple[str, ...] = get_args(BlendStrategy)


class KVBlend(BaseModel):
    """A request's ``kv_blend``: how ``kv_reuse: "blend"`` picks what it recomputes (defaults:
    the server's ``--blend-strategy`` / ``--blend-fraction``)."""

    model_config = ConfigDict(extra="forbid")
    strategy: BlendStrategy | None = None
    fraction: float | None = Field(None, ge=0, le=1)


class AgentKVFields(BaseModel):
    """agentkv's own fields on every API, consumed by the front and never sent to the engine."""

    session_id: str | None = None
    server_tools: bool | None = None     # default: the server's --server-tools
    kv_reuse: KVMode | None = None       # default: the server's --kv-reuse
    kv_blend: KVBlend | None = None


AGENTKV_FIELDS: tuple[str, ...] = ("context_management", *AgentKVFields.model_fields)


def require_utf8(body: dict[str, Any]) -> dict[str, Any]:
    """JSON may escape lone UTF-16 surrogates (``"\\ud800"``); no text can hold them: refuse with 400
    before anything is logged or sent on."""
    try:
        msgspec.json.encode(body)  # UTF-8 or UnicodeEncodeError, as json.dumps(...).encode() but faster
    except UnicodeEncodeError as exc:
        raise APIError(400, f"the request holds text that is not valid Unicode ({exc.reason})") from None
    return body
