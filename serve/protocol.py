"""The OpenAI API's request bodies (the fields this server reads) and its error body.

Unknown fields are ignored, as OpenAI-compatible servers do, so clients that send more still
work; fields that would change the output and are not supported (``echo``, penalties,
``best_of`` above ``n``, tools) are refused with a 400 naming them, never silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from paged_decode.runtime.scheduler import MAX_TOP_LOGPROBS

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


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingBody(_Body):
    """Fields both endpoints share."""

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1  # an extension (vLLM's): -1 or 0 keeps all
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: str | list[str] | None = None
    # an extension (vLLM's): ids that end the output; strict: true / "5" / 5.0 are not ids
    stop_token_ids: list[StrictInt] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    presence_penalty: Annotated[float, Field(allow_inf_nan=False)] = 0.0
    frequency_penalty: Annotated[float, Field(allow_inf_nan=False)] = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def unsupported(self) -> list[str]:
        """Fields set to something this server cannot honour."""
        out = [f for f in ("presence_penalty", "frequency_penalty") if getattr(self, f) != 0]
        return out + (["logit_bias"] if self.logit_bias else [])


class CompletionRequest(SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        out = super().unsupported() + (["echo"] if self.echo else [])
        out += ["suffix"] if self.suffix else []
        return out + (["best_of"] if self.best_of not in (None, self.n) else [])


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = Field(None, validate_default=True)
    name: str | None = None

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


class ChatRequest(SamplingBody):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list | None = None

    def unsupported(self) -> list[str]:
        return super().unsupported() + (["tools"] if self.tools else [])


def param_of(loc: tuple) -> str:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith(("function-", "list[", "str", "int", "float", "dict[")):
            out += f".{part}" if out else str(part)
    return out or "body"
