"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Validation here is what turns a malformed request into a 400 before anything is queued, and the
same models generate /openapi.json, which the fuzz tests hold the server to. Unknown fields are
ignored (clients send many optional ones, e.g. `user`, `store`, `metadata`); fields whose absence
would change the answer and that the server cannot honour yet (structured output, n > 1, ...)
are declared here so that the routes can refuse them with a message
(api_common.refuse_unsupported) rather than drop them silently. Types are JSON's: a number is a
JSON number (Int, Float) and a flag JSON's true or false (StrictBool), never a string or a 0 or 1
that pydantic would read as one.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool

MAX_TOKENS_LIMIT = 2**31 - 1   # larger values are rejected; smaller ones are clamped to the context
MAX_STOPS = 16
# characters of one stop string at most: the stream holds back text that may still become a stop
# string (holdback.py), comparing its tail with each stop's prefixes at every token
MAX_STOP_CHARS = 512
MAX_TOOL_NAME = 128  # characters of a function tool's name at most, on every surface


def _a_json_number(value: Any) -> Any:
    """JSON's true or false, or a string, where a number goes is a client's mistake, not 1 or 0
    or the number the string spells (which pydantic would make of them: `max_tokens: true` would
    answer one token), as OpenAI's API answers it."""
    if isinstance(value, (bool, str)):
        raise ValueError(f"a number is expected here, not a {'boolean' if isinstance(value, bool) else 'string'}")
    return value


Int = Annotated[int, BeforeValidator(_a_json_number)]
Float = Annotated[float, BeforeValidator(_a_json_number)]


def _an_object_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A function's arguments are a JSON object on every surface (chat's `arguments` string,
    Responses' `arguments`, Messages' `input`), so its schema may not give the top level another
    `type`: a strict tool's grammar would make its calls' arguments a bare string or number,
    which no client can take as arguments. A schema without `type` (`{}`) allows any object."""
    kind = schema.get("type")
    if kind is not None and kind != "object" and not (isinstance(kind, list) and kind == ["object"]):
        raise ValueError(f'a function\'s arguments are a JSON object: its schema\'s type must be "object", '
                         f"not {json.dumps(kind)[:80]}")
    return schema


# the JSON Schema of a function's arguments (chat and Responses `parameters`, Messages `input_schema`)
ObjectSchema = Annotated[dict[str, Any], AfterValidator(_an_object_schema)]
# OpenAI's reasoning efforts (api_common.effort_thinking turns low, medium and high into thinking)
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
# What the Responses API's `include` may ask for: output text logprobs (honoured), and outputs
# flashtree never makes (encrypted reasoning, hosted tools' results, input image URLs), which
# Codex and others ask for by default and get nothing of; any other value is a 400
ResponsesInclude = Literal["message.output_text.logprobs", "reasoning.encrypted_content",
                           "web_search_call.results", "web_search_call.action.sources",
                           "file_search_call.results", "code_interpreter_call.outputs",
                           "computer_call_output.output.image_url", "message.input_image.image_url"]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SamplingFields(_Lenient):
    """The engine's sampling knobs; ranges are checked by SamplingParams.validate()."""

    temperature: Optional[Float] = None
    top_p: Optional[Float] = None
    top_k: Optional[Int] = None
    min_p: Optional[Float] = None
    repetition_penalty: Optional[Float] = None
    frequency_penalty: Optional[Float] = None
    presence_penalty: Optional[Float] = None
    seed: Optional[Int] = None

    def sampling_dict(self) -> dict[str, Any]:
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                "frequency_penalty", "presence_penalty", "seed")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


# --- chat completions -----------------------------------------------------------------------


class TextPart(_Lenient):
    type: Literal["text", "input_text", "output_text"]
    text: str


class FunctionCallSpec(_Lenient):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class MessageToolCall(_Lenient):
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: FunctionCallSpec


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[MessageToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME)
    description: Optional[str] = None
    parameters: Optional[ObjectSchema] = None
    strict: Optional[StrictBool] = None


class ChatTool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Lenient):
    include_usage: StrictBool = False


class JsonSchemaFormat(_Lenient):
    """A named JSON schema the output must follow (structured.py enforces it, `strict` or not)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[Any] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(JsonSchemaFormat):
    """Chat's `response_format` (the schema under `json_schema`) and Responses' `text.format`
    (the schema's fields beside `type`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class ChatCompletionRequest(SamplingFields):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: Optional[list[ChatTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    max_tokens: Optional[Int] = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: Optional[Int] = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    stop: Optional[Union[str, list[str]]] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[Int] = Field(default=None, ge=1)
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[Int] = Field(default=None, ge=0, le=20)
    logit_bias: Optional[dict[str, Float]] = None
    response_format: Optional[ResponseFormat] = None
    functions: Optional[list[dict[str, Any]]] = None  # the legacy form of `tools`
    function_call: Optional[Union[str, dict[str, Any]]] = None
    modalities: Optional[list[str]] = None
    audio: Optional[dict[str, Any]] = None
    web_search_options: Optional[dict[str, Any]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    reasoning_effort: Optional[Effort] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    ignore_eos: StrictBool = False
    # vLLM's name: true continues the final assistant message, false answers it with a new turn;
    # unset, a final assistant message is continued (api_common.continues_final_message)
    continue_final_message: Optional[StrictBool] = None
    # flashtree's extension, for the chat page's decoder view: each decode step's tokens and tree
    # (`flashtree.steps`) and the answer's engine stats (`flashtree.stats`); absent unless asked
    flashtree_trace: StrictBool = False


# --- completions ------------------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    model: Optional[str] = None
    prompt: Union[str, list[Int], list[str], list[list[Int]]]
    max_tokens: Optional[Int] = Field(default=16, ge=1, le=MAX_TOKENS_LIMIT)
    stop: Optional[Union[str, list[str]]] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[Int] = Field(default=None, ge=1)
    best_of: Optional[Int] = Field(default=None, ge=1)
    echo: Optional[StrictBool] = None
    logprobs: Optional[Int] = Field(default=None, ge=0, le=5)
    logit_bias: Optional[dict[str, Float]] = None
    suffix: Optional[str] = None
    ignore_eos: StrictBool = False


# --- responses --------------------------------------------------------------------------------


class InputMessage(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: Union[str, list[TextPart]]


class ReasoningItem(_Lenient):
    """Past reasoning that clients echo back; the chat templates drop it, so do we."""

    type: Literal["reasoning"]


InputItem = Union[InputMessage, FunctionCallItem, FunctionCallOutputItem, ReasoningItem]


class ResponsesTool(_Lenient):
    """A Responses-API tool; only `function` tools reach the model, others are not served."""

    type: str
    name: Optional[str] = None
    description: Optional[str] = None
    parameters: Optional[ObjectSchema] = None
    strict: Optional[StrictBool] = None


class ResponsesNamedChoice(_Lenient):
    type: Literal["function"]
    name: str


class ReasoningOptions(_Lenient):
    effort: Optional[Effort] = None


class TextOptions(_Lenient):
    format: Optional[ResponseFormat] = None


class ResponsesRequest(SamplingFields):
    model: Optional[str] = None
    input: Union[str, list[InputItem]]
    instructions: Optional[str] = None
    tools: Optional[list[ResponsesTool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], ResponsesNamedChoice]] = None
    max_output_tokens: Optional[Int] = Field(default=None, ge=1, le=MAX_TOKENS_LIMIT)
    stream: StrictBool = False
    reasoning: Optional[ReasoningOptions] = None
    text: Optional[TextOptions] = None
    parallel_tool_calls: Optional[StrictBool] = None
    top_logprobs: Optional[Int] = Field(default=None, ge=0, le=20)
    include: Optional[list[ResponsesInclude]] = None
    background: Optional[StrictBool] = None
    previous_response_id: Optional[str] = None
    conversation: Optional[Union[str, dict[str, Any]]] = None
    prompt: Optional[dict[str, Any]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    ignore_eos: StrictBool = False


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    """The OpenAI error object every failing request gets."""

    error: ErrorDetail
