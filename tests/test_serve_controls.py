"""The request fields of paged-serve through a live server: each sampling control changes the
output as its definition says (against a numpy reference over the logits an independent B = 1
session computes), structured output in every form satisfies its constraint, and every field is
honoured, ignored (OpenAI's output-neutral ones) or refused with a 400 naming it, types strict."""

from __future__ import annotations

import json
import re
import threading

import httpx
import jsonschema
import numpy as np
import pytest

from paged_decode.runtime.kv_pool import PagedKVCache
from paged_decode.runtime.session import PagedDecodeSession

from .test_serve import SCHEMA, WAIT_S, llama, tiny  # noqa: F401  (module fixtures)

PROMPT = "the quick brown fox"


def _reference(served, prompt_ids: list[int], steps: int, control, stop_ids=()):
    """Greedy tokens of ``control(logits float64, output so far)`` over the session's logits,
    step by step: ``(tokens, finish_reason, raw logits of each step)``."""
    art = served.solo.artifact
    session = PagedDecodeSession(art, served.solo.weights, PagedKVCache.for_artifact(art))
    handle = session.pool.new_sequence()
    logits = session.prefill(handle, prompt_ids).astype(np.float64)
    out, raw = [], []
    for _ in range(steps):
        raw.append(logits)
        token = int(np.argmax(control(logits.copy(), out)))
        if token in stop_ids:
            return out, "stop", raw
        out.append(token)
        logits = session.realize_token(handle, token).astype(np.float64)
    return out, "length", raw


def _plain(x, out):
    return x


def _served_ids(served, body: dict) -> tuple[list[int], str, list[float]]:
    """A greedy chat reply's token ids (from each token's bytes), its finish reason and each
    token's log-probability."""
    r = served.client.chat.completions.create(
        model=served.name, messages=[{"role": "user", "content": PROMPT}], temperature=0,
        logprobs=True, **body)
    by_bytes = {bytes(served.engine.tokenizer.token_bytes(t)): t
                for t in range(served.engine.artifact.manifest.vocab_size)}
    content = r.choices[0].logprobs.content if r.choices[0].logprobs else []
    return ([by_bytes[bytes(e.bytes)] for e in content], r.choices[0].finish_reason,
            [e.logprob for e in content])


def _prompt(served) -> list[int]:
    return served.solo.encode_prompt(PROMPT, chat=True)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def _check(served, body: dict, control, steps: int = 12, stop_ids=()):
    """The served reply equals the reference under ``control`` and differs from the plain
    greedy reply (so the control did something); its log-probabilities are the model's own."""
    got, finish, logprobs = _served_ids(served, {"max_tokens": steps, **body})
    want, want_finish, raw = _reference(served, _prompt(served), steps, control, stop_ids)
    plain, _, _ = _reference(served, _prompt(served), steps, _plain, stop_ids)
    assert (got, finish) == (want, want_finish)
    assert want != plain, "the control changed nothing on this prompt: the test proves nothing"
    for token, lp, x in zip(got, logprobs, raw):  # the raw distribution, before the controls
        assert abs(lp - _log_softmax(x)[token]) < 1e-3
    return got


def test_logit_bias_minus_100_bans_the_greedy_token(tiny):
    greedy = _reference(tiny, _prompt(tiny), 1, _plain)[0][0]

    def ban(x, out):
        x[greedy] = -np.inf
        return x

    got = _check(tiny, {"logit_bias": {str(greedy): -100}}, ban)
    assert greedy not in got


def test_a_positive_logit_bias_adds_to_the_logit(tiny):
    def bias(x, out):
        x[7] += 9.0
        return x

    _check(tiny, {"logit_bias": {"7": 9.0}}, bias)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits(tiny):
    prompt = _prompt(tiny)

    def penalize(x, out):
        seen = sorted(set(prompt) | set(out))
        x[seen] = np.where(x[seen] > 0, x[seen] / 3.0, x[seen] * 3.0)
        return x

    _check(tiny, {"extra_body": {"repetition_penalty": 3.0}}, penalize, steps=16)


@pytest.mark.parametrize("frequency,presence", [(1.5, 0.0), (0.0, 1.5), (0.8, 0.6)])
def test_frequency_and_presence_penalties_follow_openais_definition(tiny, frequency, presence):
    def penalize(x, out):
        for t in set(out):
            x[t] -= frequency * out.count(t) + presence
        return x

    _check(tiny, {"frequency_penalty": frequency, "presence_penalty": presence}, penalize,
           steps=16)


def test_min_tokens_holds_back_the_stop_ids(tiny):
    """The greedy first token made a stop id: alone it ends the reply at once; with
    min_tokens = 3 it is banned for three tokens, then ends the reply where it wins."""
    first = _reference(tiny, _prompt(tiny), 1, _plain)[0][0]
    got, finish, _ = _served_ids(tiny, {"max_tokens": 12, "extra_body":
                                        {"stop_token_ids": [first]}})
    assert (got, finish) == ([], "stop")

    def hold(x, out):
        if len(out) < 3:
            x[first] = -np.inf
        return x

    got, finish, _ = _served_ids(tiny, {"max_tokens": 16, "extra_body": {
        "stop_token_ids": [first], "min_tokens": 3}})
    want, want_finish, _ = _reference(tiny, _prompt(tiny), 16, hold, stop_ids={first})
    assert (got, finish) == (want, want_finish) and len(got) >= 3


def test_min_tokens_and_ignore_eos_hold_back_the_end_of_sequence(llama):
    """The random Llama's EOS (id 1) pushed to the top by logit_bias: it ends the reply at
    once, after min_tokens other tokens with min_tokens, never with ignore_eos (usage counts
    the EOS token, as vLLM's does)."""
    eos = llama.engine.tokenizer.eos_ids[0]

    def reply(**extra):
        r = llama.client.completions.create(
            model=llama.name, prompt=PROMPT, max_tokens=6, temperature=0,
            extra_body={"logit_bias": {str(eos): 100}, **extra})
        return r.usage.completion_tokens, r.choices[0].finish_reason, r.choices[0].text

    assert reply() == (1, "stop", "")
    count, finish, text = reply(min_tokens=2)
    assert (count, finish) == (3, "stop") and text
    assert reply(ignore_eos=True)[:2] == (6, "length")


def test_min_p_keeps_only_tokens_at_least_that_share_of_the_top(tiny):
    """At temperature 1 every sampled token's probability is at least min_p times the most
    likely one's; without min_p the same seeds draw tokens below that share."""
    def shares(min_p):
        out = []
        for seed in range(3):
            r = tiny.client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=16,
                temperature=1.0, seed=seed, logprobs=True, top_logprobs=1,
                extra_body={} if min_p is None else {"min_p": min_p})
            out += [e.logprob - e.top_logprobs[0].logprob for e in r.choices[0].logprobs.content]
        return np.array(out)

    assert (shares(0.5) >= np.log(0.5) - 1e-4).all()
    assert (shares(None) < np.log(0.5)).any()


def test_rows_of_one_batch_each_follow_their_own_controls(tiny):
    """Four requests decoded together, each with other controls, each equal to its solo
    reference."""
    prompt = _prompt(tiny)
    greedy = _reference(tiny, prompt, 1, _plain)[0][0]

    def ban(x, out):
        x[greedy] = -np.inf
        return x

    def repeat(x, out):
        seen = sorted(set(prompt) | set(out))
        x[seen] = np.where(x[seen] > 0, x[seen] / 2.0, x[seen] * 2.0)
        return x

    def frequency(x, out):
        for t in set(out):
            x[t] -= 1.2 * out.count(t)
        return x

    cases = [({"logit_bias": {str(greedy): -100}}, ban),
             ({"extra_body": {"repetition_penalty": 2.0}}, repeat),
             ({"frequency_penalty": 1.2}, frequency), ({}, _plain)]
    got = {}

    def run(i):
        got[i] = _served_ids(tiny, {"max_tokens": 16, **cases[i][0]})[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    for i, (_, control) in enumerate(cases):
        assert got[i] == _reference(tiny, prompt, 16, control)[0], i


# -- structured output in every form ------------------------------------------------------------

def _constrained(served, extra: dict, seeds=range(3)) -> list[str]:
    texts = []
    for seed in seeds:
        r = served.client.completions.create(model=served.name, prompt="x", max_tokens=40,
                                             temperature=1.0, seed=seed, extra_body=extra)
        assert r.choices[0].finish_reason == "stop", r.choices[0].text
        texts.append(r.choices[0].text)
    return texts


@pytest.mark.parametrize("extra", [
    {"guided_json": SCHEMA},
    {"guided_json": json.dumps(SCHEMA)},  # vLLM takes the schema as JSON text too
    {"response_format": {"type": "json_object", "schema": SCHEMA}},  # llama.cpp's form
], ids=["guided_json", "guided_json-text", "json_object-schema"])
def test_json_schema_forms_validate(tiny, extra):
    for text in _constrained(tiny, extra):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_guided_choice_answers_one_of_the_choices(tiny):
    choices = ["yes", "no", "maybe so"]
    texts = _constrained(tiny, {"guided_choice": choices}, seeds=range(6))
    assert set(texts) <= set(choices)


def test_guided_regex_matches_the_pattern(tiny):
    pattern = r"[0-9]{3}-[a-z]{2}(x|yz)"
    for text in _constrained(tiny, {"guided_regex": pattern}):
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("extra,param", [
    ({"guided_json": SCHEMA, "guided_regex": "a+"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "text", "schema": SCHEMA}}, "response_format.schema"),
])
def test_bad_structured_output_requests_name_their_field(tiny, extra, param):
    r = _post(tiny, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4,
                                        **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# -- honoured, ignored or refused; strict types -------------------------------------------------

def _post(served, path: str, body) -> httpx.Response:
    return httpx.post(served.live.url + path, json=body, timeout=WAIT_S)


BASE = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path,change,param", [
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"suffix": "end"}, "suffix"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/completions", {"messages": CHAT["messages"]}, "messages"),  # a chat field
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {"verbosity": "low"}, "verbosity"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {"prompt": "hi"}, "prompt"),  # a completions field
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "x": 1}]},
     "messages[0].x"),
])
def test_each_refused_field_is_a_400_naming_it(tiny, path, change, param):
    body = (BASE if path == "/v1/completions" else CHAT) | change
    r = _post(tiny, path, body)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param, r.text
    assert error["type"] == "invalid_request_error" and param.split(".")[-1] in error["message"]


IGNORED_VALUES = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                  "prediction": {"type": "content", "content": "x"},
                  "safety_identifier": "s", "prompt_cache_key": "k"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_output_neutral_fields_are_accepted_and_change_nothing(tiny, path):
    body = (BASE if path == "/v1/completions" else CHAT) | {"temperature": 0, "max_tokens": 6}
    plain = _post(tiny, path, body)
    neutral = ({"best_of": 1} if path == "/v1/completions" else {"modalities": ["text"]})
    r = _post(tiny, path, body | IGNORED_VALUES | neutral | {"stream_options": None, "n": 1})
    assert plain.status_code == r.status_code == 200, r.text
    key = "text" if path == "/v1/completions" else "message"
    assert r.json()["choices"][0][key] == plain.json()["choices"][0][key]


STRICT = [
    ({"prompt": [True, False, True]}, "prompt[0]"),  # not token ids [1, 0, 1]
    ({"prompt": [5.0, 6.0]}, "prompt[0]"),
    ({"prompt": ["5", 6]}, "prompt[1]"),
    ({"prompt": [[5, 6], [7.0]]}, "prompt[1][0]"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"n": "2"}, "n"),
    ({"top_k": "5"}, "top_k"),
    ({"seed": 1.5}, "seed"),
    ({"stream": "true"}, "stream"),
    ({"temperature": "0.5"}, "temperature"),
    ({"logit_bias": {"5": "10"}}, "logit_bias.5"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": -101}}, "logit_bias.5"),
    ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
    ({"min_tokens": "1"}, "min_tokens"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
]


@pytest.mark.parametrize("change,param", STRICT, ids=[json.dumps(c) for c, _ in STRICT])
def test_no_json_type_is_coerced(tiny, change, param):
    r = _post(tiny, "/v1/completions", BASE | change)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    if param.startswith("prompt"):  # a union: the message lists the forms it takes
        assert "prompt takes one of" in r.json()["error"]["message"]


def test_strict_types_hold_in_chat_messages_too(tiny):
    for messages, param in [([{"role": "user", "content": ["hi"]}], "messages[0].content[0]"),
                            ([{"role": "user", "content": "hi", "name": 3}], "messages[0].name")]:
        r = _post(tiny, "/v1/chat/completions", CHAT | {"messages": messages})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
