"""How each chat-template family writes tool calls: the text that opens a call, the parser that
turns a reply into calls, and the llguidance (Lark) grammar that keeps a call's arguments inside
its function's JSON schema.

Families (``--tool-call-parser`` names them; by default the template's own text picks one):

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per
  call (Qwen2.5, Qwen3, Hermes, and the generic preamble of templates without tools);
- ``llama3_json``: the reply is ``{"name": ..., "parameters": {...}}`` (calls joined by ``; ``),
  optionally after ``<|python_tag|>`` (Llama 3.1 / 3.2 / 3.3);
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": {...}}``.
"""

from __future__ import annotations

import dataclasses
import json
import re

# the JSON the grammar writes: compact, as the response_format schemas (runtime/grammar.py)
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_PYTHON_TAG = "<|python_tag|>"


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    open: str  # the text that opens the calls ("": the whole reply is the calls)
    close: str  # the text that closes one call ("" when none)
    args_key: str  # "arguments" or "parameters"

    def call_start(self, text: str, sent: bool) -> int | None:
        """Where the calls begin in ``text`` (None: not yet); ``sent``: some text went out."""
        if self.open:
            at = text.find(self.open)
            return None if at < 0 else at
        head = text.lstrip()
        if not sent and head.startswith(("{", _PYTHON_TAG)):
            return 0
        return None

    def held(self, text: str, sent: bool) -> int:
        """How many of ``text``'s last characters may still turn out to open a call."""
        if not self.open:
            head = text.lstrip()
            return len(text) if not sent and _PYTHON_TAG.startswith(head) else 0
        for n in range(min(len(self.open) - 1, len(text)), 0, -1):
            if self.open.startswith(text[-n:]):
                return n
        return 0

    def parse(self, text: str) -> tuple[str, list[tuple[str, dict]]]:
        """``text`` as (content, [(name, arguments)]); what does not parse stays content."""
        return _PARSERS[self.name](self, text)


HERMES = Family("hermes", "<tool_call>", "</tool_call>", "arguments")
LLAMA3_JSON = Family("llama3_json", "", "", "parameters")
MISTRAL = Family("mistral", "[TOOL_CALLS]", "", "arguments")
FAMILIES = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


def family_of(template: str | None) -> Family:
    """The family a chat template's source speaks (hermes when it shows none)."""
    source = template or ""
    if "[TOOL_CALLS]" in source:
        return MISTRAL
    if "<tool_call>" in source:
        return HERMES
    if _PYTHON_TAG in source or ('"parameters"' in source and "<|eot_id|>" in source):
        return LLAMA3_JSON
    return HERMES


def _call_of(obj, key: str) -> tuple[str, dict] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


def _json_at(text: str, at: int):
    """The JSON value starting at or after ``at`` (whitespace skipped) and where it ends."""
    decoder = json.JSONDecoder()
    while at < len(text) and text[at].isspace():
        at += 1
    return decoder.raw_decode(text, at)


def _parse_hermes(fam: Family, text: str):
    calls, content, at = [], [], 0
    while (start := text.find(fam.open, at)) >= 0:
        content.append(text[at:start])
        end = text.find(fam.close, start)
        body = text[start + len(fam.open):end if end >= 0 else len(text)]
        try:
            call = _call_of(json.loads(body), fam.args_key)
        except ValueError:
            call = None
        stop = len(text) if end < 0 else end + len(fam.close)
        if call is None:
            content.append(text[start:stop])
        else:
            calls.append(call)
        at = stop
    content.append(text[at:])
    return "".join(content).strip(), calls


def _parse_llama3(fam: Family, text: str):
    body = text.strip().removeprefix(_PYTHON_TAG)
    calls, at = [], 0
    try:
        while at < len(body):
            obj, at = _json_at(body, at)
            call = _call_of(obj, fam.args_key)
            if call is None:
                return text.strip(), []
            calls.append(call)
            rest = body[at:].lstrip()
            at = len(body) - len(rest) + (1 if rest.startswith(";") else 0)
            if rest and not rest.startswith(";"):
                return text.strip(), []
    except ValueError:
        return text.strip(), []
    return "", calls


_ARGS = re.compile(r"([A-Za-z0-9_.\-]{1,64})\[ARGS\]")


def _parse_mistral(fam: Family, text: str):
    start = text.find(fam.open)
    if start < 0:
        return text.strip(), []
    head, body = text[:start], text[start + len(fam.open):]
    try:
        if body.lstrip().startswith("["):
            items, _ = _json_at(body, 0)
            calls = [_call_of(o, fam.args_key) for o in items] if isinstance(items, list) else [None]
        else:  # the newer layout: name[ARGS]{...} per call
            calls, at = [], 0
            while (m := _ARGS.match(body, at)) is not None:
                args, at = _json_at(body, m.end())
                calls.append(_call_of({"name": m.group(1), "arguments": args}, "arguments"))
                while at < len(body) and (body[at].isspace() or body.startswith(fam.open, at)):
                    at += len(fam.open) if body.startswith(fam.open, at) else 1
    except ValueError:
        calls = [None]
    if not calls or None in calls:
        return text.strip(), []
    return head.strip(), calls


_PARSERS = {"hermes": _parse_hermes, "llama3_json": _parse_llama3, "mistral": _parse_mistral}


# -- grammars ------------------------------------------------------------------------------------

def call_schema(fam: Family, name: str, parameters: dict) -> dict:
    """The JSON schema of one call of ``name`` in ``fam``'s object layout."""
    return {"x-guidance": _JSON_OPTIONS, "type": "object", "additionalProperties": False,
            "properties": {"name": {"const": name}, fam.args_key: parameters},
            "required": ["name", fam.args_key]}


def lark_grammar(fam: Family, functions: dict[str, dict], *, required: bool, parallel: bool,
                 literal) -> str:
    """A Lark grammar (llguidance's dialect) for a reply: the calls alone (``required``), or
    free text that, once it opens a call, continues in the call syntax; every call's
    arguments under its function's schema.  ``literal(text)`` spells a marker for the grammar
    (a special token's ``<[id]>``, or a quoted string)."""
    rules = ["%llguidance {}"]
    opening = literal(fam.open) if fam.open else ""
    if fam.name == "mistral":
        items = {"anyOf": [call_schema(fam, n, p) for n, p in functions.items()]}
        array = {"x-guidance": _JSON_OPTIONS, "type": "array", "items": items, "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        rules.append(f"after: %json {json.dumps(array)}")
        parallel = False  # one array holds every call
    else:
        bodies = [f"body_{i}" for i in range(len(functions))]
        rules += [f"{b}: %json {json.dumps(call_schema(fam, n, p))}"
                  for b, (n, p) in zip(bodies, functions.items())]
        rules.append(f"body: {' | '.join(bodies)}")
        rules.append(f'after: "\\n" body "\\n" {literal(fam.close)}' if fam.open
                     else "after: body")
    more = (' ("\\n" call)*' if fam.open else ' ("; " call)*') if parallel else ""
    rules.append(f"call: {opening} after")
    if required:
        start = f"call{more}"
    elif not fam.open:
        start = f"TEXT | call{more}"
    elif opening.startswith("<["):  # a special token: free text cannot hold it
        start = f"TEXT | TEXT call{more}"
    else:  # spelled out: the text up to it is one lazy lexeme, which ends at the opening
        rules.append(f"head[lazy]: TEXT {opening}")
        start = f"TEXT | head after{more}"
    rules.insert(1, f"start: {start}")
    if not required:
        # free text never holds the opening spelled out, so every call is a constrained one
        banned = re.escape(fam.open) if fam.open else r"\s*\{"
        lead = "(?s:.*)" if fam.open else ""
        rules.append(f"TEXT: /(?s:.*)/ & ~/{lead}{banned}(?s:.*)/")
    return "\n".join(rules) + "\n"
