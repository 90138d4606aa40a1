"""Request bodies of the Anthropic Messages endpoints (/v1/messages, /v1/messages/count_tokens).

Claude Code and the `anthropic` SDKs send many fields a local server has no use for
(`metadata`, `cache_control` on blocks, `context_management`, `service_tier`, ...): unknown fields
are ignored so that a new client version does not break on a field added upstream. What the
model cannot take in (images, documents) is refused by validation with a message naming it,
and what the server cannot do yet (`mcp_servers`) by the route, rather than silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from .schemas import MAX_STOP_CHARS, MAX_STOPS, MAX_TOKENS_LIMIT, MAX_TOOL_NAME, Float, Int, ObjectSchema


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock], None] = None
    is_error: StrictBool = False


class ThinkingBlock(_Lenient):
    """Past reasoning echoed back by the client; its signature means nothing to this server."""

    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None


class RedactedThinkingBlock(_Lenient):
    type: Literal["redacted_thinking"]
    data: str = ""


ContentBlock = Annotated[Union[TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                               RedactedThinkingBlock], Field(discriminator="type")]


class Message(_Lenient):
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[ContentBlock]]


class Tool(_Lenient):
    """A client tool with a JSON-schema `input_schema`. Anthropic-defined tools (a `type` such as
    `web_search_20250305`) run on Anthropic's side, which this server is not: they are skipped."""

    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME)
    type: Optional[str] = None
    description: Optional[str] = None
    input_schema: Optional[ObjectSchema] = None


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[StrictBool] = None


class Thinking(_Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[Int] = Field(default=None, ge=1)


class Conversation(_Lenient):
    """What both endpoints render into a prompt."""

    model: Optional[str] = None
    messages: list[Message] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None


class MessagesRequest(Conversation):
    max_tokens: Int = Field(ge=1, le=MAX_TOKENS_LIMIT)
    stop_sequences: Optional[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]]] = Field(default=None,
                                                                                     max_length=MAX_STOPS)
    stream: StrictBool = False
    temperature: Optional[Float] = Field(default=None, ge=0, le=1)  # Anthropic's range, not OpenAI's
    top_p: Optional[Float] = Field(default=None, ge=0, le=1)
    top_k: Optional[Int] = Field(default=None, ge=0)
    mcp_servers: Optional[list[dict[str, Any]]] = None

    def sampling_dict(self) -> dict[str, Any]:
        keys = ("temperature", "top_p", "top_k")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


class CountTokensRequest(Conversation):
    pass


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """The Anthropic error object every failing Messages request gets."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
