"""Reading a request body: bounded in size and nesting, strict UTF-8 and JSON, validated
strictly against its model, every failure an :class:`~.protocol.APIError` (OpenAI's shape).

The routes read their bodies themselves (not through FastAPI's parameters), after the API key
is checked: a request without the key is a 401 whatever its body holds, and no body is parsed
for a client that may not send one.  The nesting is measured before ``json.loads`` runs, so a
100,000-deep body costs a scan, not a recursion.
"""

from __future__ import annotations

import json
import re

import numpy as np
from pydantic import BaseModel, ValidationError

from .protocol import APIError, is_type_tag, param_of

MAX_BODY_BYTES = 16 * 2**20  # a 100k-token prompt as text or ids is well under this
MAX_DEPTH = 64  # objects and arrays inside each other; a JSON schema nests ~2 per level
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


async def read_body(request) -> bytes:
    """The raw body, at most ``MAX_BODY_BYTES`` (a 413 past it, before reading it all)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise _too_large()
    return bytes(data)


def _too_large() -> APIError:
    return APIError(413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB; send "
                    "a shorter prompt (token ids take less room than their text in JSON)")


def nesting(raw: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (strings' brackets not counted)."""
    b = np.frombuffer(_STRING.sub(b'""', raw), np.uint8)
    if not len(b):
        return 0
    step = np.isin(b, _OPEN).astype(np.int32) - np.isin(b, _CLOSE).astype(np.int32)
    return int(np.cumsum(step).max(initial=0))


def parse_json(raw: bytes, content_type: str | None):
    """The JSON value of a body, or a 400 saying what is wrong with it."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise APIError(400, f"the request body must be JSON sent with 'Content-Type: "
                       f"application/json' (got {kind or 'no Content-Type'!r})")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start}: "
                       f"{raw[e.start:e.start + 1]!r})") from None
    depth = nesting(raw)
    if depth > MAX_DEPTH:
        raise APIError(400, f"the request body nests {depth} levels of arrays / objects, "
                       f"more than the {MAX_DEPTH} this server reads")
    try:
        value = json.loads(text)
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    _check_strings(value)
    return value


def _check_strings(value, path: str = "") -> None:
    """A lone surrogate (``"\\ud800"``) is valid JSON and no text: refused, naming where."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, f"{path or 'body'}: a string holds an unpaired UTF-16 "
                               "surrogate escape, which is not text", path or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, path)
            _check_strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_strings(v, f"{path}[{i}]")


def validate(model: type[BaseModel], value) -> BaseModel:
    """``value`` as ``model`` (strict: no type is coerced), or a 400 naming the first field at
    fault."""
    if not isinstance(value, dict):
        raise APIError(400, f"the request body must be a JSON object, got "
                       f"{type(value).__name__}")
    try:
        return model.model_validate(value, strict=True)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


def validation_error(errors: list[dict]) -> APIError:
    """One 400 for pydantic's errors: of a union's alternatives, the error that went deepest
    into the value says most."""
    if not errors:
        return APIError(400, "the request body is not valid")
    first = max(errors, key=lambda e: sum(isinstance(p, int) for p in e.get("loc", ())))
    param = param_of(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"{param}: this server does not know this field, so it cannot "
                        "honour it; leave it out (docs/serving.md lists every field)", param)
    msg = str(first.get("msg")).removeprefix("Value error, ")  # pydantic's, for our checks
    return APIError(400, f"{param}: {msg}{_union_forms(errors, first)}", param)


def _union_forms(errors: list[dict], first: dict) -> str:
    """Where the field is a union (``prompt``: text, texts, token ids or lists of them), the
    forms it takes: one alternative's complaint alone would read as the only form."""
    loc = tuple(first.get("loc", ()))
    at = next((i for i, p in enumerate(loc) if isinstance(p, str) and is_type_tag(p)), None)
    if at is None:
        return ""
    forms = list(dict.fromkeys(e["loc"][at] for e in errors if tuple(e.get("loc", ()))[:at]
                               == loc[:at] and len(e["loc"]) > at
                               and isinstance(e["loc"][at], str) and is_type_tag(e["loc"][at])))
    if len(forms) < 2:
        return ""
    return f" ({param_of(loc[:at])} takes one of: {', '.join(forms)}; JSON types are not " \
           "converted)"
