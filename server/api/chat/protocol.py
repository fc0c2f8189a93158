"""Chat Completions (and Completions) request bodies, validated at the edge. Unknown fields pass
through to vLLM untouched; the engine fields the server decides are ``options.EngineBound``'s."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agentkv.compaction.policy import ContextManagement
from agentkv.server.options import AGENTKV_FIELDS, AgentKVFields, EngineBound, require_utf8

Role = Literal["system", "developer", "user", "assistant", "tool"]


class _PassThrough(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionCall(_PassThrough):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_PassThrough):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_PassThrough):
    role: Role
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content: Any) -> Any:
        """A content part names its type; a text part's text is a string (null or a number is a
        400 naming the part, never a failure later)."""
        for i, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type", "text")
            if not isinstance(kind, str):
                raise ValueError(f"part {i}: 'type' must be a string")
            if kind == "text" and not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: a text part's 'text' must be a string")
        return content


class StreamOptions(_PassThrough):
    include_usage: bool | None = None


class _Sampling(_PassThrough):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=16)


class ChatCompletionRequest(_Sampling, AgentKVFields):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=20_000)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    context_management: ContextManagement | None = None   # agentkv's (Anthropic's edits, on chat)


class CompletionRequest(_Sampling, EngineBound):
    prompt: str | list[str] | list[int] | list[list[int]]


def forward_body(req: _Sampling, model_name: str) -> dict[str, Any]:
    """The JSON sent on to vLLM: what the client sent (less agentkv's own fields), with the served
    model name filled in."""
    body = req.model_dump(exclude_unset=True, exclude_none=False, exclude=set(AGENTKV_FIELDS))
    body["model"] = req.model or model_name
    return require_utf8(body)
