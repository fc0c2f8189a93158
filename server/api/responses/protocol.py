"""OpenAI Responses request bodies, validated at the edge. Fields the Responses API does not define
pass on to the engine (vLLM's sampling extensions), but for the engine fields only the server sets
(``options.SERVER_ONLY``) and those echoed only (``NOT_SENT``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentkv.compaction.policy import ContextManagement
from agentkv.server.options import AgentKVFields, EngineBound


class Reasoning(BaseModel):
    model_config = ConfigDict(extra="allow")
    effort: str | None = None
    summary: str | None = None


class CompactionSetting(BaseModel):
    """One entry of OpenAI's ``context_management`` list."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["compaction"]
    compact_threshold: int | None = Field(None, ge=1)


class _Input(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(default_factory=list, max_length=20_000)
    instructions: str | None = None
    previous_response_id: str | None = Field(None, max_length=128)
    prompt_cache_key: str | None = None
    metadata: dict[str, Any] | None = None


class ResponsesRequest(_Input, AgentKVFields):
    model_config = ConfigDict(extra="allow")
    tools: list[dict[str, Any]] | None = Field(None, max_length=1024)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    include: list[str] | None = None
    reasoning: Reasoning | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    # OpenAI's compaction list, or agentkv's {"edits": [...]} form, as on chat:
    context_management: list[CompactionSetting] | ContextManagement | None = None


class CompactRequest(_Input, EngineBound):
    model: str
    session_id: str | None = None   # agentkv's own


# Responses fields accepted and echoed in the response, never sent to the engine; other unknown
# fields pass through to it (vLLM's own sampling fields: top_k, seed, structured_outputs, ...).
ECHOED = ("user", "safety_identifier", "service_tier", "prompt_cache_retention", "client_metadata",
          "max_tool_calls")
NOT_SENT = (*ECHOED, "stream_options")
