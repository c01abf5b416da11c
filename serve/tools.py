"""Tool calling on ``/v1/chat/completions``: OpenAI's ``tools`` / ``tool_choice`` (and the
legacy ``functions`` / ``function_call``) turned into a prompt, a grammar and, from the reply,
``message.tool_calls``.

- The prompt is the model's chat template rendered with the ``tools`` Jinja variable (as HF
  passes it: ``[{"type": "function", "function": {...}}]``), history included: assistant
  ``tool_calls`` (arguments as objects) and ``role: "tool"`` results (with ``tool_call_id`` and
  the called function's ``name``).  A template that never reads ``tools`` gets
  :data:`GENERIC_PREAMBLE` in its system message instead, and the history as text.
- The reply runs under a grammar (:func:`.tool_format.lark_grammar`): ``required`` and a named
  function allow only calls; ``auto`` allows free text, and once the reply opens a call the
  call follows its syntax and every argument object its function's JSON schema.  ``none``
  leaves the tools out of the prompt and the reply as text.
- The reply is split into content and calls by the template family's parser
  (:mod:`.tool_format`; ``--tool-call-parser`` overrides the choice).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import re
import secrets
import string

from paged_decode.runtime.errors import GrammarError, InputError
from paged_decode.runtime.grammar import GrammarUnavailableError
from paged_decode.runtime.tokenizer import check_chat_template, check_text

from .protocol import APIError
from .tool_format import FAMILIES, Family, family_of, lark_grammar

# Given to templates that do not read ``tools``; ``{tools}``: one JSON schema per line,
# ``{example}``: the family's call syntax.
GENERIC_PREAMBLE = (
    "You can call functions to answer. They are described by these JSON schemas:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with nothing but the call, in this form:\n{example}\n"
    "Otherwise reply with text.")
_EXAMPLES = {
    "hermes": '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n'
              '</tool_call>\n(one such block per call)',
    "llama3_json": '{"name": <function-name>, "parameters": <arguments-object>}',
    "mistral": '[TOOL_CALLS][{"name": <function-name>, "arguments": <arguments-object>}]',
}
_NO_ARGS = {"type": "object", "properties": {}}
_TOOLS_VAR = re.compile(r"\btools\b")


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What one request asks of the tools: the functions offered (name -> parameters schema),
    the ones the grammar allows, and how the reply is read."""

    family: Family
    tools: tuple[dict, ...]  # as the template gets them
    functions: dict  # name -> parameters schema, every tool
    allowed: tuple[str, ...]  # the functions a call may name
    required: bool  # the reply is calls only
    parallel: bool
    legacy: bool  # asked with ``functions``: answered with ``function_call``

    def split(self, text: str) -> tuple[str | None, list[dict]]:
        """A whole reply as (content or None, OpenAI tool calls)."""
        content, calls = self.family.parse(text)
        opening = self.family.open
        if opening and opening in content:
            # a call cut short by max_tokens: the grammar keeps the opening out of free text,
            # so from it on is an unfinished call, not content
            content = content[:content.index(opening)]
        elif self.required and not calls:  # calls only, and none finished
            content = ""
        if any(name not in self.allowed for name, _ in calls):
            return text.strip() or None, []
        if not self.parallel:
            calls = calls[:1]
        return content or None, [self._call(name, args) for name, args in calls]

    def _call(self, name: str, args: dict) -> dict:
        if self.family.name == "mistral":  # its templates check for nine alphanumerics
            cid = "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        else:
            cid = "call_" + secrets.token_hex(12)
        return {"id": cid, "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}

    def stream(self) -> "CallStream":
        return CallStream(self)

    async def constraint(self, engine):
        """The reply's grammar as a constraint (built off the event loop)."""
        functions = {n: self.functions[n] for n in self.allowed}
        tok = engine.tokenizer
        lark = lark_grammar(self.family, functions, required=self.required,
                            parallel=self.parallel, literal=functools.partial(_literal, tok))

        def build():
            import llguidance

            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
            # GrammarCompiler builds matchers from llguidance grammars of any source
            return engine.grammars._matcher(grammar, "the tools' schemas")
        try:
            return await asyncio.to_thread(build)
        except GrammarUnavailableError as e:  # this tokenizer, not the request
            param = "tool_choice" if self.required else "tools"
            raise APIError(400, f"{param}: tool calls are constrained by a grammar, and {e}",
                           param) from e
        except (GrammarError, ValueError) as e:
            raise APIError(400, f"tools: a function's parameters are not a usable JSON schema "
                           f"({e})", "tools") from e


def _literal(tok, text: str) -> str:
    """``text`` in a grammar: the special-token form when it is one added token (llguidance
    matches those only as tokens), a quoted string otherwise."""
    ids = tok.encode(text, add_bos=False)
    added = tok.backend.get_added_tokens_decoder()
    if len(ids) == 1 and ids[0] in added and added[ids[0]].content == text:
        return f"<[{ids[0]}]>"
    return json.dumps(text)


class CallStream:
    """One choice's reply, piece by piece: content that can go out now; the calls at the end.

    Text that might open a call is held back until it does or cannot; from the opening on, the
    rest is held and parsed at the end (one ``delta.tool_calls`` entry per call)."""

    def __init__(self, plan: ToolPlan):
        self.plan, self.held, self.in_calls, self.sent = plan, "", False, False

    def push(self, text: str) -> str:
        self.held += text
        if self.in_calls:
            return ""
        fam = self.plan.family
        start = fam.call_start(self.held, self.sent)
        if start is not None:
            out, self.held, self.in_calls = self.held[:start], self.held[start:], True
        else:
            keep = fam.held(self.held, self.sent)
            cut = len(self.held) - keep
            out, self.held = self.held[:cut], self.held[cut:]
        self.sent = self.sent or bool(out.strip())
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content not yet sent, the calls)."""
        if not self.in_calls:
            return self.held, []
        content, calls = self.plan.split(self.held)
        # what is held starts at a call's opening: without a finished call it is an unfinished
        # one (max_tokens), not text
        return ("" if content is None else content), calls


# -- the request --------------------------------------------------------------------------------

def tool_plan(body, tokenizer, parser: str | None = None) -> ToolPlan | None:
    """The request's tool plan; None when it offers no tools or chooses none."""
    legacy = body.functions is not None
    if legacy and body.tools is not None:
        raise APIError(400, "functions: give tools or the legacy functions, not both",
                       "functions")
    defs = ([t.function for t in body.tools] if body.tools is not None else
            list(body.functions) if legacy else [])
    choice = body.function_call if legacy else body.tool_choice
    field = "function_call" if legacy else "tool_choice"
    if not defs:
        if choice not in (None, "none", "auto"):
            raise APIError(400, f"{field}: {_choice_text(choice)} needs tools", field)
        return None
    functions = {}
    for i, d in enumerate(defs):
        if d.name in functions:
            raise APIError(400, f"tools[{i}].function.name: '{d.name}' is offered twice",
                           f"tools[{i}].function.name")
        functions[d.name] = d.parameters if d.parameters is not None else _NO_ARGS
    if choice == "none":
        return None
    allowed = tuple(functions)
    if choice not in (None, "auto", "required"):
        name = choice.name if legacy else choice.function.name
        if name not in functions:
            raise APIError(400, f"{field}: names the function '{name}', which is not among "
                           f"the tools ({', '.join(functions)})", field)
        allowed = (name,)
    _check_no_other_constraint(body)
    family = FAMILIES[parser] if parser else family_of(tokenizer.chat_template)
    tools = tuple({"type": "function", "function": d.model_dump(exclude_none=True)}
                  for d in defs)
    forced = allowed != tuple(functions) or choice == "required"
    parallel = (not legacy and body.parallel_tool_calls is not False
                and choice in (None, "auto", "required"))
    return ToolPlan(family, tools, functions, allowed, forced, parallel, legacy)


def _check_no_other_constraint(body) -> None:
    for field in ("response_format", "guided_json", "guided_choice", "guided_regex"):
        value = getattr(body, field, None)
        if value is not None and getattr(value, "type", None) != "text":
            raise APIError(400, f"{field}: cannot be combined with tools (both constrain the "
                           "reply); leave one out, or set tool_choice to \"none\"", field)


def _choice_text(choice) -> str:
    return json.dumps(choice if isinstance(choice, str) else choice.model_dump())


def uses_tools(body) -> bool:
    """The request offers tools or its history holds calls or results."""
    return (body.tools is not None or body.functions is not None or any(
        m.role in ("tool", "function") or m.tool_calls or m.function_call
        for m in body.messages))


def prompt_ids(tokenizer, body, plan: ToolPlan | None) -> list[int] | None:
    """The prompt of a request that uses tools (None for one that does not: the plain path)."""
    if plan is None and not uses_tools(body):
        return None
    source = tokenizer.chat_template
    reads_tools = bool(_TOOLS_VAR.search(source))
    messages = _messages(body, plan, generic=not reads_tools)
    tools = list(plan.tools) if plan is not None and reads_tools else None
    bos = tokenizer.token(tokenizer.bos_id) or ""
    eos = (tokenizer.token(tokenizer.eos_ids[0]) or "") if tokenizer.eos_ids else ""
    try:
        text = _compiled(source).render(messages=messages, tools=tools, bos_token=bos,
                                        eos_token=eos, add_generation_prompt=True)
    except Exception as e:  # the template is the model's code: it can raise anything
        raise APIError(400, f"messages: the model's chat template failed while rendering the "
                       f"messages with tools ({type(e).__name__}: {e}); give messages and "
                       "tools the template accepts", "messages") from e
    try:
        return tokenizer.encode(text, add_bos=False)
    except InputError as e:
        raise APIError(400, f"messages: {e}", "messages") from e


@functools.lru_cache(maxsize=4)
def _compiled(source: str):
    return check_chat_template(source)


def _messages(body, plan: ToolPlan | None, generic: bool) -> list[dict]:
    names: dict[str, str] = {}  # call id -> function name, for the results that follow
    out = []
    for i, m in enumerate(body.messages):
        text = m.text()
        try:
            check_text(text, f"messages[{i}].content")
        except InputError as e:
            raise APIError(400, str(e), f"messages[{i}].content") from e
        calls = _history_calls(m, i, names)
        if m.role in ("tool", "function"):
            cid = m.tool_call_id or ""
            name = m.name if m.role == "function" else names.get(cid, m.name or "")
            out.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
                       if generic else
                       {"role": "tool", "content": text, "tool_call_id": cid, "name": name})
        elif calls and generic:
            blocks = "\n".join(_as_text(plan, c) for c in calls)
            out.append({"role": "assistant", "content": f"{text}\n{blocks}".strip()})
        elif calls:
            out.append({"role": "assistant", "content": text, "tool_calls": calls})
        else:
            out.append({"role": m.role, "content": text})
    if generic and plan is not None:
        _add_preamble(out, plan)
    return out


def _history_calls(m, i: int, names: dict) -> list[dict]:
    """An assistant message's calls, arguments parsed (templates write them as objects)."""
    raw = list(m.tool_calls or [])
    if m.function_call is not None:
        raw.append({"id": f"call_{i}", "function": m.function_call})
    calls = []
    for j, c in enumerate(raw):
        cid, fn = (c["id"], c["function"]) if isinstance(c, dict) else (c.id, c.function)
        args = fn.arguments
        where = f"messages[{i}].tool_calls[{j}].function.arguments"
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise APIError(400, f"{where}: not valid JSON ({e})", where) from e
        if not isinstance(args, dict):
            raise APIError(400, f"{where}: must be a JSON object", where)
        names[cid] = fn.name
        calls.append({"id": cid, "type": "function",
                      "function": {"name": fn.name, "arguments": args}})
    return calls


def _as_text(plan: ToolPlan | None, call: dict) -> str:
    fam = plan.family if plan is not None else FAMILIES["hermes"]
    obj = json.dumps({"name": call["function"]["name"],
                      fam.args_key: call["function"]["arguments"]}, ensure_ascii=False)
    if fam.name == "mistral":
        return f"{fam.open}[{obj}]"
    return f"{fam.open}\n{obj}\n{fam.close}" if fam.open else obj


def _add_preamble(messages: list[dict], plan: ToolPlan) -> None:
    schemas = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in plan.tools)
    preamble = GENERIC_PREAMBLE.format(tools=schemas, example=_EXAMPLES[plan.family.name])
    if messages and messages[0]["role"] in ("system", "developer"):
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{preamble}"}
    else:
        messages.insert(0, {"role": "system", "content": preamble})
