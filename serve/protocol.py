"""The OpenAI API's request bodies (every field this server accepts) and its error body.

Strict: JSON types are never coerced (``"max_tokens": "10"``, ``true`` as a token id, ``5.0`` as
an integer are 400s naming the field), and nothing is dropped silently.  Every field is honoured,
or accepted and ignored because it cannot change the output (:data:`IGNORED`: ``user``,
``metadata``, ``store``...), or refused with a 400 naming it: a field this server does not know
(``extra="forbid"``), or one it knows but cannot honour set to anything but its neutral value
(``unsupported()``).  docs/serving.md has the table.  Bodies are validated with
``model_validate(..., strict=True)``, which holds nested models to the same rule.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from paged_decode.runtime.scheduler import MAX_TOP_LOGPROBS

from .tool_schema import (CalledFunction, FunctionCallChoice, FunctionDef, Tool, ToolCall,
                          ToolChoice)

MAX_N = 16  # continuations per prompt in one request


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": None}}


# accepted and ignored: they describe the caller or the billing, not the output
IGNORED = ("user", "metadata", "store", "service_tier", "prediction", "safety_identifier",
           "prompt_cache_key")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # padding of stream events: nothing to pad here


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None  # OpenAI's hint to the model; the schema is what binds
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # llama.cpp's json_object form


class SamplingBody(_Body):
    """Fields both endpoints share."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0  # vLLM's: stop ids held back until then
    ignore_eos: bool = False  # vLLM's: end-of-sequence ids do not end the output
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1  # an extension (vLLM's): -1 or 0 keeps all
    min_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] = 0.0  # vLLM's
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: str | list[str] | None = None
    # an extension (vLLM's): ids that end the output; strict: true / "5" / 5.0 are not ids
    stop_token_ids: list[int] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=100, allow_inf_nan=False)] = 1.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None \
        = None
    # vLLM's structured-output fields, through the same constraint as response_format
    guided_json: dict[str, Any] | str | None = None
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1)]],
                             Field(min_length=1)] | None = None
    guided_regex: str | None = None
    # IGNORED
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    def unsupported(self) -> list[str]:
        """Fields set to something this server cannot honour."""
        return []


class CompletionRequest(SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None

    def unsupported(self) -> list[str]:
        out = super().unsupported() + (["echo"] if self.echo else [])
        out += ["suffix"] if self.suffix else []
        return out + (["best_of"] if self.best_of not in (None, self.n) else [])


class ChatOnly(SamplingBody):
    """OpenAI chat fields this server knows and cannot honour: refused when set."""

    reasoning_effort: str | None = None
    verbosity: str | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    web_search_options: dict[str, Any] | None = None

    def unsupported(self) -> list[str]:
        out = [f for f in ("reasoning_effort", "verbosity", "audio", "web_search_options")
               if getattr(self, f) is not None]
        return out + (["modalities"] if self.modalities not in (None, ["text"]) else [])


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant: the calls it made (serve/tools.py)
    tool_call_id: str | None = None  # tool: the call this is the result of
    function_call: CalledFunction | None = None  # legacy assistant call

    @field_validator("content", mode="after")
    @classmethod
    def _content_unless_assistant(cls, content, info):
        if content is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"a {info.data['role']} message needs content")
        return content

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(ChatOnly):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[Tool] | None = None  # tool calling: serve/tools.py
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDef] | None = None  # the legacy form of tools
    function_call: FunctionCallChoice | None = None


_TYPE_TAGS = frozenset(("str", "int", "float", "bool", "none", "dict", "list"))


def is_type_tag(part: str) -> bool:
    """pydantic's name for a union's alternative (``str``, ``list[int]``,
    ``function-after[...]``, a model's class name), which is no field: field names are
    lower-case identifiers (``stream`` and ``store`` too, though they begin like ``str``)."""
    return part in _TYPE_TAGS or any(c in part for c in "[-(") or part[:1].isupper()


def param_of(loc: tuple) -> str:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not is_type_tag(part):
            out += f".{part}" if out else str(part)
    return out or "body"


class TokenizeRequest(_Body):
    """``POST /tokenize`` as vLLM (``prompt`` or ``messages``) and llama-server (``content``)
    take it."""

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool = True  # vLLM's: the BOS, where the model adds one
    add_special: bool | None = None  # llama-server's name for it
    add_generation_prompt: bool = True  # messages: end with the assistant's turn opened
    with_pieces: bool = False  # llama-server's: tokens as {"id", "piece"}
    return_token_strs: bool = False  # vLLM's: "token_strs" beside the ids


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
