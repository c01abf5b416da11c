"""The request bodies' tool objects (OpenAI's ``tools``, ``tool_choice``, assistant
``tool_calls`` and the legacy ``functions`` / ``function_call``), strict: an unknown field in
one of them is a 400 naming it, as a mistyped schema would otherwise be dropped silently."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# OpenAI's rule for function names; the grammar writes them into JSON strings as they are
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class FunctionDef(_Strict):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # arguments always follow the schema here, strict or not


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
FunctionCallChoice = Literal["none", "auto"] | NamedFunction


class CalledFunction(_Strict):
    name: FunctionName
    arguments: str | dict[str, Any]  # a JSON string as OpenAI sends it (an object accepted too)


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction
