"""agentkv's own request fields, beside each API's, the engine fields the server alone decides, and
the KV reuse modes' names (each mode is a class of ``kv_modes``): declared once.

Every API's request model takes ``AgentKVFields`` (``context_management`` is declared per API: it
is also Anthropic's and OpenAI's own field, in their shapes); the server's config and the
benchmarks take the same ``KVMode`` and ``BlendStrategy``. ``EngineBound`` declares the engine
fields a client may not set as it likes: those in ``SERVER_ONLY`` (they steer the KV connector:
which blocks it holds, under which session, what it loads where) are refused with a 400 naming
the field, and ``cache_salt`` is combined with the server's own salt (``pipeline.cache_salt``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, get_args

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from .errors import APIError
from .kv_modes import mode_literal

if TYPE_CHECKING:
    KVMode = str   # what a type checker can know of a Literal built at run time: a mode's name
else:
    KVMode = mode_literal()   # the registered KV reuse modes (``kv_modes``): Literal["recompute", "shift", "blend"]
KV_MODES: tuple[str, ...] = get_args(KVMode)
BlendStrategy = Literal["tail", "cuts", "deviation"]
EngineInputMode = Literal["tokens", "messages"]
BLEND_STRATEGIES: tuple[str, ...] = get_args(BlendStrategy)


class KVBlend(BaseModel):
    """A request's ``kv_blend``: how ``kv_reuse: "blend"`` picks what it recomputes (defaults:
    the server's ``--blend-strategy`` / ``--blend-fraction``)."""

    model_config = ConfigDict(extra="forbid")
    strategy: BlendStrategy | None = None
    fraction: float | None = Field(None, ge=0, le=1)


SERVER_ONLY: tuple[str, ...] = ("kv_transfer_params", "vllm_xargs", "ec_transfer_params")


class EngineBound(BaseModel):
    """Engine fields only the server sets (``SERVER_ONLY``: a 400 when a client sends one, null
    included) or sets with the client's part in it (``cache_salt``). Never dumped: what reaches
    the engine of them is the server's."""

    kv_transfer_params: Any = Field(None, exclude=True)
    vllm_xargs: Any = Field(None, exclude=True)
    ec_transfer_params: Any = Field(None, exclude=True)
    cache_salt: str | None = Field(None, min_length=1, max_length=256, exclude=True)

    @field_validator(*SERVER_ONLY, mode="before")
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        raise ValueError(f"{info.field_name} is set by the server only (it steers the KV connector); "
                         "remove it from the request")


class AgentKVFields(EngineBound):
    """agentkv's own fields on every API, consumed by the front and never sent to the engine."""

    session_id: str | None = None
    server_tools: bool | None = None     # default: the server's --server-tools
    kv_reuse: KVMode | None = None       # default: the server's --kv-reuse
    kv_blend: KVBlend | None = None
    engine_input: EngineInputMode | None = None   # messages: this request's prompt rendered by vLLM


AGENTKV_FIELDS: tuple[str, ...] = ("context_management", *AgentKVFields.model_fields)


def require_utf8(body: dict[str, Any]) -> dict[str, Any]:
    """JSON may escape lone UTF-16 surrogates (``"\\ud800"``); no text can hold them: refuse with 400
    before anything is logged or sent on."""
    try:
        msgspec.json.encode(body)  # UTF-8 or UnicodeEncodeError, as json.dumps(...).encode() but faster
    except UnicodeEncodeError as exc:
        raise APIError(400, f"the request holds text that is not valid Unicode ({exc.reason})") from None
    return body
