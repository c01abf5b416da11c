"""Tool calling: the parsers per template family, the prompt against transformers' rendering of
the same tool-aware template, the grammars driven token by token, and the OpenAI client against
a live server on a random Qwen2 checkpoint saved with Qwen2.5's tool-calling chat template
(tests/data/qwen2_5_tools.jinja)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import numpy as np
import openai
import pytest

from paged_decode.runtime.grammar import GrammarCompiler
from paged_decode.runtime.tokenizer import Tokenizer
from paged_decode.serve.protocol import ChatRequest
from paged_decode.serve.tool_format import FAMILIES, family_of
from paged_decode.serve.tools import prompt_ids, tool_plan

from .conftest import CHAT_TEMPLATE, _byte_bpe_tokenizer, _randomize, _save
from .test_serve import Served

QWEN_TEMPLATE = (Path(__file__).parent / "data" / "qwen2_5_tools.jinja").read_text()
OPTS = dict(block_size=16, max_context=2048, batch_buckets=(2, 4))
VOCAB = 320

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}}}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} somewhere",
                                           "parameters": s}} for n, s in SCHEMAS.items()]


def _tool_backend():
    """The conftest byte-level BPE with Qwen's chat and tool-call tokens added, and no BOS."""
    from tokenizers import AddedToken

    tok = _byte_bpe_tokenizer()
    tok.post_processor = None
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True),
                            AddedToken("<|im_end|>", special=True)])
    tok.add_tokens([AddedToken("<tool_call>", special=False),
                    AddedToken("</tool_call>", special=False)])
    return tok


@pytest.fixture(scope="session")
def qwen_tools_ckpt(tmp_path_factory):
    """Qwen2ForCausalLM (random, float32) with the tool-token tokenizer and Qwen2.5's
    tool-calling chat template; ``<|im_end|>`` is its EOS."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    backend = _tool_backend()
    eos = backend.token_to_id("<|im_end|>")
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=96, vocab_size=VOCAB,
                      tie_word_embeddings=False, eos_token_id=eos, bos_token_id=None)
    model = Qwen2ForCausalLM(cfg)
    _randomize(model, seed=5)
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    fast.chat_template = QWEN_TEMPLATE
    return _save(model, tmp_path_factory, "qwen2_tools", extra=fast.save_pretrained)


def _tokenizer(template: str = QWEN_TEMPLATE) -> Tokenizer:
    backend = _tool_backend()
    return Tokenizer(backend, None, [backend.token_to_id("<|im_end|>")], False, template)


def _request(**fields) -> ChatRequest:
    fields.setdefault("messages", [{"role": "user", "content": "weather in Paris?"}])
    return ChatRequest(model="m", **fields)


def _validate(calls) -> None:
    for c in calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]),
                            SCHEMAS[c["function"]["name"]])


# -- parsers -----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, content, calls", [
    ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
     '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>', "Sure.",
     [("f", {"a": 1}), ("g", {})]),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', "", [("f", {"a": 1})]),  # cut short
    ('<tool_call>\n{"name": "f", "argu\n</tool_call> ok', '<tool_call>\n{"name": "f", "argu\n'
     '</tool_call> ok', []),  # a broken block stays text
    ("no calls here", "no calls here", []),
])
def test_hermes_parser(text, content, calls):
    assert FAMILIES["hermes"].parse(text) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1})]),
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {}}', "",
     [("f", {"a": 1}), ("g", {})]),
    ('{"name": "f", "parameters": {"a": 1}} and text', '{"name": "f", "parameters": {"a": 1}} '
     'and text', []),
    ('The answer is {"a": 1}', 'The answer is {"a": 1}', []),
    ('{"not": "a call"}', '{"not": "a call"}', []),
])
def test_llama3_json_parser(text, content, calls):
    assert FAMILIES["llama3_json"].parse(text) == (content, calls)


@pytest.mark.parametrize("text, content, calls", [
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": "{}"}]', "",
     [("f", {"a": 1}), ("g", {})]),
    ('Let me see. [TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]{}', "Let me see.",
     [("f", {"a": 1}), ("g", {})]),
    ('[TOOL_CALLS][{"name": "f"', '[TOOL_CALLS][{"name": "f"', []),
    ("plain", "plain", []),
])
def test_mistral_parser(text, content, calls):
    assert FAMILIES["mistral"].parse(text) == (content, calls)


@pytest.mark.parametrize("snippet, family", [
    (QWEN_TEMPLATE, "hermes"),
    ("{{ '<|start_header_id|>ipython<|end_header_id|>' }}{{ '<|python_tag|>' }}<|eot_id|>",
     "llama3_json"),
    ('{{ "[AVAILABLE_TOOLS]" }}{{ "[TOOL_CALLS]" }}', "mistral"),
    (CHAT_TEMPLATE, "hermes"),  # no tool syntax: the generic preamble's
])
def test_family_from_template(snippet, family):
    assert family_of(snippet).name == family


def test_stream_holds_back_only_what_may_open_a_call():
    plan = tool_plan(_request(tools=TOOLS), _tokenizer())
    reply = 'Let me <b>check</b>.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": 2}}'
    reply += "\n</tool_call>"
    stream, sent = plan.stream(), []
    for ch in reply:
        sent.append(stream.push(ch))
        assert "<tool_call>" not in "".join(sent)
    rest, calls = stream.finish()
    assert "".join(sent) + rest == "Let me <b>check</b>.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_time", {"zone": 2})]


# -- the prompt ----------------------------------------------------------------------------------

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
]


def test_prompt_is_the_template_rendered_with_tools_as_transformers_does(qwen_tools_ckpt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen_tools_ckpt.path)
    tok = _tokenizer()
    body = _request(messages=HISTORY, tools=TOOLS)
    hf_history = [dict(m) for m in HISTORY]
    hf_history[2] = {**HISTORY[2], "content": "", "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}
    want = hf.apply_chat_template(hf_history, tools=TOOLS, tokenize=False,
                                  add_generation_prompt=True)
    assert "<tool_response>\n21 C\n</tool_response>" in want  # the history is in it
    assert prompt_ids(tok, body, tool_plan(body, tok)) == tok.encode(want, add_bos=False)


def test_template_without_tools_gets_the_generic_preamble():
    tok = _tokenizer(CHAT_TEMPLATE)
    body = _request(messages=HISTORY, tools=TOOLS)
    text = tok.decode(prompt_ids(tok, body, tool_plan(body, tok)))
    system = text.split("</s>")[0]
    assert system.startswith("<|system|>Be brief.\n\nYou can call functions")
    assert json.dumps(TOOLS[0]["function"]) in system
    assert ('<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"unit": "celsius"}}\n</tool_call></s>') in text
    assert "<|user|><tool_response>\n21 C\n</tool_response></s><|assistant|>" in text


def test_tool_choice_none_leaves_the_tools_out():
    tok = _tokenizer()
    body = _request(tools=TOOLS, tool_choice="none")
    assert tool_plan(body, tok) is None
    assert "# Tools" not in tok.decode(prompt_ids(tok, body, None))


# -- the grammars, driven token by token -------------------------------------------------------

def _walk(constraint, tok: Tokenizer, prefix: str, seed: int, steps: int = 400) -> str:
    """``prefix`` fed through ``constraint``, then tokens drawn uniformly among those it
    allows until it is done, or allows EOS and a coin says stop; the text of it all."""
    rng = np.random.default_rng(seed)
    ids = tok.encode(prefix, add_bos=False) if prefix else []
    for t in ids:
        constraint.accept(t)
    eos = tok.eos_ids[0]
    for _ in range(steps):
        if constraint.done:
            return tok.decode(ids)
        allowed = constraint.allowed()
        if allowed[eos] and rng.random() < 0.5:
            return tok.decode(ids)
        token = int(rng.choice(np.flatnonzero(allowed)))
        if token == eos:
            return tok.decode(ids)
        constraint.accept(token)
        ids.append(token)
    raise AssertionError(f"no end after {steps} tokens: {tok.decode(ids)!r}")


def _constraint(plan, tok: Tokenizer):
    import asyncio

    engine = SimpleNamespace(tokenizer=tok, grammars=GrammarCompiler(tok, VOCAB))
    return asyncio.run(plan.constraint(engine))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("template", ["tool tokens", "plain text"])
def test_a_call_opened_in_auto_mode_follows_the_schema(family, template):
    """Free text, then the family's opening text: from there on, whatever is drawn, the reply
    parses into calls whose arguments validate (the opening as an added token, and spelled
    out in a vocabulary without it)."""
    tok = _tokenizer() if template == "tool tokens" else _tokenizer(CHAT_TEMPLATE)
    if template == "plain text":
        tok = Tokenizer(_byte_bpe_tokenizer(), None, [1], False, CHAT_TEMPLATE)
    plan = tool_plan(_request(tools=TOOLS), tok, parser=family)
    opening = {"hermes": "Checking. <tool_call>", "llama3_json": "{",
               "mistral": "Checking. [TOOL_CALLS]"}[family]
    for seed in range(3):
        text = _walk(_constraint(plan, tok), tok, opening, seed)
        content, calls = plan.split(text)
        assert calls, text
        _validate(calls)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_required_allows_calls_only(family):
    tok = _tokenizer()
    plan = tool_plan(_request(tools=TOOLS, tool_choice="required"), tok, parser=family)
    for seed in range(3):
        text = _walk(_constraint(plan, tok), tok, "", seed)
        content, calls = plan.split(text)
        assert content is None and calls, text
        _validate(calls)


def test_a_call_cut_short_is_not_content():
    """max_tokens in the middle of a second call: the first call stands, the unfinished one is
    dropped, not returned as text."""
    plan = tool_plan(_request(tools=TOOLS), _tokenizer(), parser="hermes")
    whole = '<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}\n</tool_call>'
    content, calls = plan.split(f'Checking. {whole}\n<tool_call>\n{{"name": "get_weather", "ar')
    assert content.strip() == "Checking." and [c["function"]["name"] for c in calls] == ["get_time"]


@pytest.mark.parametrize("choice", [None, "required"])
def test_a_lone_call_cut_short_is_neither_content_nor_a_call(choice):
    """max_tokens before the first call finished: no markup reaches the client, whole or
    streamed (finish_reason says length)."""
    plan = tool_plan(_request(tools=TOOLS, tool_choice=choice), _tokenizer(), parser="hermes")
    cut = 'Checking. <tool_call>\n{"name' if choice is None else '<tool_call>\n{"name'
    content, calls = plan.split(cut)
    assert calls == [] and (content or "").strip() == ("Checking." if choice is None else "")
    stream = plan.stream()
    sent = stream.push(cut)
    rest, calls = stream.finish()
    assert calls == [] and "<tool_call>" not in sent + rest


def test_auto_text_never_spells_out_the_opening():
    tok = _tokenizer()
    constraint = _constraint(tool_plan(_request(tools=TOOLS), tok), tok)
    for t in tok.encode("see <tool_call", add_bos=False):
        constraint.accept(t)
    assert not constraint.allowed()[tok.encode(">", add_bos=False)[0]]


# -- the OpenAI client against a live server ------------------------------------------------------

@pytest.fixture(scope="module")
def served(build, qwen_tools_ckpt):
    s = Served(build(qwen_tools_ckpt.path, **OPTS), "qwen-tools", max_running=4)
    yield s
    s.close()


def _hf_prompt_len(ckpt, messages, tools) -> int:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ckpt.path)
    return len(hf.apply_chat_template(messages, tools=tools, tokenize=True,
                                      add_generation_prompt=True)["input_ids"])


def _call_history(message) -> dict:
    return {"role": "assistant", "content": message.content, "tool_calls": [
        {"id": c.id, "type": "function",
         "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in message.tool_calls]}


def _follow_up(first: dict, calls) -> list[dict]:
    results = [{"role": "tool", "tool_call_id": c["id"], "content": '{"temperature": 21}'}
               for c in first["tool_calls"]]
    return [{"role": "user", "content": "weather in Paris?"}, first] + results


def test_weather_round_trip(served, qwen_tools_ckpt):
    """The call (tool_choice required), the tool's result, the final answer (auto)."""
    user = [{"role": "user", "content": "weather in Paris?"}]
    r = served.client.chat.completions.create(model="qwen-tools", messages=user, tools=TOOLS,
                                              tool_choice="required", temperature=0,
                                              parallel_tool_calls=False, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = [c.model_dump() for c in choice.message.tool_calls]
    assert calls and all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    _validate(calls)
    history = _follow_up(_call_history(choice.message), calls)
    final = served.client.chat.completions.create(model="qwen-tools", messages=history,
                                                  tools=TOOLS, temperature=0, max_tokens=16)
    hf_history = [dict(m) for m in history]
    hf_history[1] = {**history[1], "content": "", "tool_calls": [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in history[1]["tool_calls"]]}
    assert final.usage.prompt_tokens == _hf_prompt_len(qwen_tools_ckpt, hf_history, TOOLS)
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    if answer.message.tool_calls:  # auto: the random model may call again, within the schema
        _validate([c.model_dump() for c in answer.message.tool_calls])
    else:
        assert isinstance(answer.message.content, str)


def _reassemble(stream) -> tuple[str, list[dict], str | None]:
    """Stream chunks put together as OpenAI's client documentation does it."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "type": "function",
                                                   "function": {"name": "", "arguments": ""}})
                call["id"] = tc.id or call["id"]
                call["function"]["name"] += (tc.function.name or "") if tc.function else ""
                call["function"]["arguments"] += (tc.function.arguments or "") \
                    if tc.function else ""
            finish = choice.finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def test_weather_round_trip_streamed(served):
    user = [{"role": "user", "content": "weather in Paris?"}]
    # one call: a random model given the choice may open call after call until max_tokens
    kwargs = dict(model="qwen-tools", tools=TOOLS, temperature=0, max_tokens=120,
                  parallel_tool_calls=False)
    content, calls, finish = _reassemble(served.client.chat.completions.create(
        messages=user, tool_choice="required", stream=True, **kwargs))
    whole = served.client.chat.completions.create(messages=user, tool_choice="required",
                                                  **kwargs).choices[0].message
    assert finish == "tool_calls" and content == ""
    assert [c["function"] for c in calls] == [c.function.model_dump() for c in whole.tool_calls]
    assert all(c["id"] for c in calls)
    _validate(calls)
    history = _follow_up({"role": "assistant", "content": None, "tool_calls": calls}, calls)
    content, more, finish = _reassemble(served.client.chat.completions.create(
        messages=history, stream=True, **{**kwargs, "max_tokens": 16}))
    assert finish in ("stop", "length", "tool_calls")
    _validate(more)


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_enforced_calls_always_validate(served, choice):
    """20 seeded samples at temperature 1: every one is calls only, arguments valid."""
    for seed in range(20):
        r = served.client.chat.completions.create(
            model="qwen-tools", messages=[{"role": "user", "content": "go"}], tools=TOOLS,
            tool_choice=choice, temperature=1, seed=seed, max_tokens=200,
            parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", (seed, c)
        calls = [t.model_dump() for t in c.message.tool_calls]
        if isinstance(choice, dict):
            assert [t["function"]["name"] for t in calls] == ["get_weather"]
        _validate(calls)


def test_legacy_functions_answer_with_function_call(served):
    r = served.client.chat.completions.create(
        model="qwen-tools", messages=[{"role": "user", "content": "go"}],
        functions=[t["function"] for t in TOOLS], function_call={"name": "get_time"},
        temperature=0, max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason == "function_call" and c.message.tool_calls is None
    jsonschema.validate(json.loads(c.message.function_call.arguments), TIME)


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_requests_are_400s_naming_the_field(served, fields, param):
    body = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, **fields}
    with pytest.raises(openai.BadRequestError) as e:
        served.client.chat.completions.create(model="qwen-tools", max_tokens=4, **body)
    assert e.value.body["param"] == param
    assert served.all_free()
