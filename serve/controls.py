"""A request's sampling controls and structured-output constraint, from its body.

Structured output comes from one of four forms, all through the llguidance constraint
(runtime/grammar.py): OpenAI's ``response_format`` (``json_object``, ``json_schema``), llama.cpp's
``response_format: {"type": "json_object", "schema": ...}``, and vLLM's ``guided_json``,
``guided_choice`` and ``guided_regex``.  More than one in a request is a 400: which would win
is not for the server to guess.
"""

from __future__ import annotations

import asyncio
import json

from paged_decode.runtime.errors import GrammarError, InputError
from paged_decode.runtime.sampling import SamplingParams

from .protocol import APIError, SamplingBody

_CONTROLS = ("temperature", "top_p", "seed", "min_p", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "min_tokens", "ignore_eos")


def sampling_params(body: SamplingBody, vocab_size: int, max_tokens: list[int]
                    ) -> SamplingParams:
    """The body's sampling fields as :class:`SamplingParams`; a 400 naming the field at fault
    (``logit_bias`` keys must be token ids of this model, ``min_tokens`` within
    ``max_tokens``)."""
    if body.min_tokens > min(max_tokens):
        raise APIError(400, f"min_tokens: {body.min_tokens} is more than max_tokens "
                       f"({min(max_tokens)}); lower it", "min_tokens")
    kwargs = {f: getattr(body, f) for f in _CONTROLS}
    try:
        params = SamplingParams(top_k=max(body.top_k, 0), logit_bias=_bias(body, vocab_size),
                                **kwargs)
    except InputError as e:  # the fields' own ranges catch these first; named all the same
        name = str(e).split("=")[0].split(":")[0]
        raise APIError(400, str(e), name if name in _CONTROLS else None) from e
    return params


def _bias(body: SamplingBody, vocab_size: int) -> dict[int, float]:
    out = {}
    for key, value in (body.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit() and int(key) < vocab_size):
            raise APIError(400, f"logit_bias: the key {key!r} is not a token id of this model "
                           f"(a decimal string, 0 to {vocab_size - 1})", "logit_bias")
        out[int(key)] = value
    return out


def grammar_spec(body: SamplingBody):
    """``(param, kind, argument)`` of the request's structured output, or None.  ``kind``:
    ``"json"`` (argument: a schema, None for any object), ``"choice"``, ``"regex"``."""
    asked = []
    fmt = body.response_format
    if fmt is not None and fmt.type != "text":
        asked.append(("response_format", "json", _format_schema(fmt)))
    elif fmt is not None and fmt.schema_ is not None:
        raise APIError(400, "response_format.schema: only with type json_object (llama.cpp's "
                       "form) or json_schema", "response_format.schema")
    if body.guided_json is not None:
        asked.append(("guided_json", "json", _schema_value(body.guided_json)))
    if body.guided_choice is not None:
        asked.append(("guided_choice", "choice", body.guided_choice))
    if body.guided_regex is not None:
        asked.append(("guided_regex", "regex", body.guided_regex))
    if len(asked) > 1:
        raise APIError(400, f"{asked[1][0]}: only one structured-output field per request "
                       f"(this one asks {asked[0][0]} too)", asked[1][0])
    return asked[0] if asked else None


def _format_schema(fmt):
    if fmt.type == "json_object":
        return fmt.schema_  # llama.cpp's schema; None: any JSON object
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise APIError(400, "response_format.json_schema.schema is required for type "
                       "json_schema", "response_format.json_schema.schema")
    return fmt.json_schema.schema_


def _schema_value(value):
    if isinstance(value, str):  # vLLM takes the schema as a JSON text too
        try:
            value = json.loads(value)
        except ValueError as e:
            raise APIError(400, f"guided_json: not a JSON schema ({e})", "guided_json") from None
    if not isinstance(value, dict):
        raise APIError(400, "guided_json: a JSON schema is an object", "guided_json")
    return value


async def build_grammar(engine, spec):
    """The constraint ``spec`` (:func:`grammar_spec`) asks for, built off the event loop (the
    tokenizer index at first use, then the grammar); a 400 naming the field when it cannot be
    built, or when structured output is unavailable for this model's tokenizer."""
    if spec is None:
        return None
    param, kind, arg = spec

    def build():
        grammars = engine.grammars
        if kind == "choice":
            return grammars.choice(arg)
        return grammars.regex(arg) if kind == "regex" else grammars.json_schema(arg)

    try:
        return await asyncio.to_thread(build)
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param) from e
