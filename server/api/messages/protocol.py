"""Anthropic Messages request bodies, validated at the edge. Unknown fields are accepted (vLLM's
sampling extensions pass on), but for the engine fields only the server sets (``options.SERVER_ONLY``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agentkv.compaction.policy import ContextManagement
from agentkv.server.options import AgentKVFields, EngineBound


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(..., min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class _Conversation(EngineBound):
    """What /v1/messages and /v1/messages/count_tokens share. Unknown fields are accepted."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    messages: list[AnthropicMessage] = Field(..., min_length=1, max_length=20_000)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    # agentkv's own (context_management is also Anthropic's):
    context_management: ContextManagement | None = None


class ThreadCreate(BaseModel):
    """``thread: {"type": "create"}``: keep this conversation, its system prompt and tools, under the
    response's id (beta ``message-threads-2026-08-12``)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["create"]


class ThreadContinue(BaseModel):
    """``thread: {"type": "continue", "previous_message_id"}``: the messages sent follow that response."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["continue"]
    previous_message_id: str = Field(..., min_length=1, max_length=128)


class CompactionOnDemand(BaseModel):
    """``compaction: {"type": "summarize", "instructions"?}``: answer with the conversation as one signed
    ``compaction`` block instead of a reply (beta ``compact-2026-09-04``)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["summarize"]
    instructions: str | None = Field(None, min_length=1)


class MessagesRequest(_Conversation, AgentKVFields):
    model_config = ConfigDict(extra="allow")
    max_tokens: int = Field(..., ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    thread: Annotated[ThreadCreate | ThreadContinue, Field(discriminator="type")] | None = None
    compaction: CompactionOnDemand | None = None
