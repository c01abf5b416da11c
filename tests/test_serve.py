"""paged-serve through the official ``openai`` client: a server on 127.0.0.1 per model (uvicorn
on a thread of this process, so the tests can reach the engine), and the command itself in a
subprocess for the signal and bind checks.  Every request loop is bounded."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import jsonschema
import numpy as np
import openai
import pytest
import uvicorn
from click.testing import CliRunner

from paged_decode.cli import serve_cmd
from paged_decode.runtime.batch_engine import BatchEngine
from paged_decode.runtime.engine import Engine
from paged_decode.runtime.kv_pool import PagedKVCache
from paged_decode.runtime.sampling import SamplingParams
from paged_decode.runtime.session import PagedDecodeSession
from paged_decode.serve import draining_server
from paged_decode.serve.app import create_app
from paged_decode.runtime.tokenizer import Tokenizer
from paged_decode.serve.render import TextOffsets, completion_logprobs

from .conftest import BUCKETS, CHAT_TEMPLATE, LOGIT_TOL
from .test_tokenizer_input import byte_fallback_backend

OPTS = dict(block_size=4, max_context=64, batch_buckets=BUCKETS)
WAIT_S = 30  # the most any bounded wait below lasts

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "ok"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                         "ok": {"type": "boolean"}}}


class LiveServer:
    """uvicorn serving ``app`` on 127.0.0.1 (a free port) from a thread of its own."""

    def __init__(self, app):
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + WAIT_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=WAIT_S, **kwargs)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)


class Served:
    """A model behind a live server, with the engine and a solo reference engine."""

    def __init__(self, prepared, name: str, chat_template: str | None = None, **engine_opts):
        self.name = name
        api_key = engine_opts.pop("api_key", None)
        self.engine = BatchEngine.load(prepared.artifact_dir, prepared.weights_dir, **engine_opts)
        self.solo = Engine.load(prepared.artifact_dir, prepared.weights_dir)
        if chat_template is not None:
            for tok in (self.engine.tokenizer, self.solo.tokenizer):
                tok.set_chat_template(chat_template)
        self.app = create_app(self.engine, name, api_key=api_key)
        self.live = LiveServer(self.app)
        self.client = self.live.client()

    def close(self) -> None:
        self.live.close()
        self.engine.close()

    def solo_text(self, prompt: str, max_tokens: int, chat: bool = False) -> str:
        return "".join(self.solo.stream_text(prompt, chat=chat, max_new_tokens=max_tokens))

    def all_free(self) -> bool:
        """Nothing running, and every block free once the prefix cache lets go of its own."""
        sched = self.engine.scheduler
        deadline = time.monotonic() + WAIT_S
        while self.engine.stats()["running"] or self.engine.stats()["waiting"]:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        sched.cache.evict(self.engine.pool.num_blocks)
        sched.pool.allocator.check_invariants()
        return self.engine.pool.num_free == self.engine.pool.num_blocks


@pytest.fixture(scope="module")
def tiny(build):
    served = Served(build("tiny", **OPTS), "tiny", chat_template=CHAT_TEMPLATE)
    yield served
    served.close()


@pytest.fixture(scope="module")
def llama(build, llama_ckpt):
    served = Served(build(llama_ckpt.path, **OPTS), "random-llama")
    yield served
    served.close()


@pytest.fixture(params=["tiny", "llama"])
def model(request) -> Served:
    return request.getfixturevalue(request.param)


# -- the API as clients use it -----------------------------------------------------------------

def test_models_lists_the_served_model(model):
    listed = model.client.models.list()
    assert [m.id for m in listed.data] == [model.name]


@pytest.mark.parametrize("chat", [False, True])
def test_greedy_output_equals_the_model_run_alone(model, chat):
    prompts = ["hello", "the quick brown fox"]
    for prompt in prompts:
        want = model.solo_text(prompt, 12, chat=chat)
        if chat:
            r = model.client.chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": prompt}],
                max_tokens=12, temperature=0)
            got = r.choices[0].message.content
        else:
            r = model.client.completions.create(model=model.name, prompt=prompt, max_tokens=12,
                                                temperature=0)
            got = r.choices[0].text
        assert got == want
        assert r.usage.prompt_tokens == len(model.solo.encode_prompt(prompt, chat))
        if r.choices[0].finish_reason == "length":
            assert r.usage.completion_tokens == 12
        else:  # the model's end-of-sequence id, counted, not shown
            assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 12
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_several_prompts_in_one_completion_request(tiny):
    ids = tiny.solo.encode_prompt("paged")
    r = tiny.client.completions.create(model="tiny", prompt=["hello", "fox"], max_tokens=6,
                                       temperature=0, n=2)
    texts = {c.index: c.text for c in r.choices}
    assert texts == {0: tiny.solo_text("hello", 6), 1: tiny.solo_text("hello", 6),
                     2: tiny.solo_text("fox", 6), 3: tiny.solo_text("fox", 6)}
    by_ids = tiny.client.completions.create(model="tiny", prompt=ids, max_tokens=6,
                                            temperature=0)
    assert by_ids.choices[0].text == tiny.solo_text("paged", 6)


@pytest.mark.parametrize("chat", [False, True])
def test_streaming_equals_the_whole_response(model, chat):
    kwargs = dict(model=model.name, max_tokens=10, temperature=0,
                  stream_options={"include_usage": True})
    if chat:
        kwargs["messages"] = [{"role": "user", "content": "paged"}]
        whole = model.client.chat.completions.create(**kwargs)
        chunks = list(model.client.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
        want = whole.choices[0].message.content
    else:
        kwargs["prompt"] = "paged"
        whole = model.client.completions.create(**kwargs)
        chunks = list(model.client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        want = whole.choices[0].text
    assert text == want
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == whole.choices[0].finish_reason and set(finals[:-1]) == {None}
    # the token counts; the cached ones differ (the second request finds the first's blocks)
    counts = {"prompt_tokens_details"}
    assert chunks[-1].choices == [] and (chunks[-1].usage.model_dump(exclude=counts)
                                         == whole.usage.model_dump(exclude=counts))


def test_the_event_stream_ends_with_done(tiny):
    conn = http.client.HTTPConnection("127.0.0.1", tiny.live.port, timeout=WAIT_S)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "a", "max_tokens": 5, "stream": True}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = [e for e in resp.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-1])


def test_n_choices_with_a_seed_are_reproducible_and_distinct(model):
    kwargs = dict(model=model.name, prompt="hello", max_tokens=8, temperature=1.0, seed=7, n=3)
    first = model.client.completions.create(**kwargs)
    again = model.client.completions.create(**kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) > 1  # continuation i samples with seed + i
    other = model.client.completions.create(**{**kwargs, "seed": 8, "n": 1})
    assert other.choices[0].text == texts[1]  # continuation 1 of seed 7 samples with seed 8
    if all(c.finish_reason == "length" for c in first.choices):
        assert first.usage.completion_tokens == 3 * 8


def test_a_stop_string_cuts_the_text_before_it(model):
    full = model.solo_text("hello", 16)
    stop = full[4:6]
    r = model.client.completions.create(model=model.name, prompt="hello", max_tokens=16,
                                        temperature=0, stop=[stop, "\x00never"])
    assert r.choices[0].text == full[:full.find(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_stop_token_ids_end_the_text_before_their_token(model):
    """vLLM's ``stop_token_ids`` extension: the output ends before the named id's text."""
    ids = model.solo.encode_prompt("hello")
    tokens = model.solo.generator.generate(ids, 16, stop_ids=model.solo.tokenizer.eos_ids)
    assert len(tokens) > 3
    cut = tokens.index(tokens[3])
    r = model.client.completions.create(model=model.name, prompt="hello", max_tokens=16,
                                        temperature=0, extra_body={"stop_token_ids": [tokens[3]]})
    assert r.choices[0].text == "".join(model.solo.stream_ids_text(ids, max_new_tokens=cut))
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == cut + 1


def test_a_pool_smaller_than_the_context_bounds_what_a_request_gets(build):
    """A KV pool of fewer tokens than the model's context: a request without max_tokens gets
    what the pool holds (not a 400 about a max_tokens it never sent); one asking for more is a
    400 naming max_tokens and the KV cache."""
    small = Served(build("tiny", **OPTS), "tiny", num_blocks=3)
    try:
        held = 3 * small.engine.pool.block_size
        assert held < small.engine.artifact.max_tokens
        prompt = small.solo.encode_prompt("hello")
        r = small.client.completions.create(model="tiny", prompt="hello", temperature=0)
        assert r.usage.completion_tokens <= held - len(prompt) + 1
        assert r.choices[0].finish_reason in ("length", "stop")
        with pytest.raises(openai.BadRequestError) as err:
            small.client.completions.create(model="tiny", prompt="hello", max_tokens=held)
        assert err.value.body["param"] == "max_tokens"  # the client unwraps "error"
        assert "--kv-cache-gb" in err.value.body["message"]
    finally:
        small.close()


def test_logprobs_match_the_models_own_distribution(tiny):
    """The first token's log-probabilities against a log-softmax (float64 numpy) of the logits
    an independent B = 1 session computes for the same prompt."""
    r = tiny.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=4)
    ids = tiny.solo.encode_prompt("hi", chat=True)
    art = tiny.solo.artifact
    session = PagedDecodeSession(art, tiny.solo.weights, PagedKVCache.for_artifact(art))
    logits = session.prefill(session.pool.new_sequence(), ids).astype(np.float64)
    logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    first = r.choices[0].logprobs.content[0]
    best = int(np.argmax(logp))
    assert abs(first.logprob - logp[best]) < LOGIT_TOL["float32"]
    assert first.token == tiny.engine.tokenizer.decode([best])
    order = np.argsort(-logp, kind="stable")[:4]
    assert [t.logprob for t in first.top_logprobs] == pytest.approx(logp[order].tolist(),
                                                                    abs=LOGIT_TOL["float32"])
    assert len(r.choices[0].logprobs.content) == 3


def test_completion_logprobs_have_the_legacy_layout(tiny):
    r = tiny.client.completions.create(model="tiny", prompt="hello", max_tokens=4,
                                       temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text


@pytest.mark.parametrize("fmt", ["json_schema", "json_object"])
def test_structured_output_parses_and_validates(model, fmt):
    if fmt == "json_schema":
        response_format = {"type": "json_schema",
                           "json_schema": {"name": "answer", "schema": SCHEMA}}
    else:
        response_format = {"type": "json_object"}
    finished = 0
    for seed in range(4):
        r = model.client.completions.create(
            model=model.name, prompt="x", max_tokens=60, temperature=1.0, seed=seed,
            extra_body={"response_format": response_format})
        text = r.choices[0].text
        if fmt == "json_object" and r.choices[0].finish_reason == "length":
            assert text.startswith("{")  # a random model's string can outrun max_tokens
            continue
        assert r.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA if fmt == "json_schema"
                            else {"type": "object"})
        finished += 1
    assert finished >= 1


def test_a_constrained_request_leaves_others_unchanged(tiny):
    """An unconstrained greedy request decoded in the same batches as constrained ones."""
    want = tiny.solo_text("the quick brown fox", 20)
    got = {}

    def constrained(i):
        got[i] = tiny.client.completions.create(
            model="tiny", prompt="x", max_tokens=60, temperature=0.7, seed=i,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {
                "name": "a", "schema": SCHEMA}}}).choices[0].text

    threads = [threading.Thread(target=constrained, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    plain = tiny.client.completions.create(model="tiny", prompt="the quick brown fox",
                                           max_tokens=20, temperature=0)
    for t in threads:
        t.join(WAIT_S)
    assert plain.choices[0].text == want
    assert all(jsonschema.validate(json.loads(got[i]), SCHEMA) is None for i in range(4))


# -- many clients ------------------------------------------------------------------------------

def test_32_concurrent_streams_each_equal_their_solo_run(model):
    prompts = [f"hello {i}" if i % 2 else f"the fox {i}" for i in range(32)]
    want = [model.solo_text(p, 10) for p in prompts]
    got: list = [None] * 32
    barrier = threading.Barrier(32)

    def client(i):
        barrier.wait(WAIT_S)
        stream = model.client.completions.create(model=model.name, prompt=prompts[i],
                                                 max_tokens=10, temperature=0, stream=True)
        got[i] = "".join(c.choices[0].text for c in stream if c.choices)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):  # the server answers while the streams decode
        assert model.client.with_options(timeout=5).models.list().data
        threads[0].join(0.05)
    for t in threads:
        t.join(WAIT_S)
    assert got == want
    assert model.all_free()


# -- faults ------------------------------------------------------------------------------------

@pytest.fixture
def slow_steps(tiny, monkeypatch):
    """Each engine step takes at least 20 ms, so a request outlives a client's first chunk."""
    runner = tiny.engine.scheduler.runner
    real = runner.run

    def slow(*args):
        time.sleep(0.02)
        return real(*args)

    monkeypatch.setattr(runner, "run", slow)


def _recorded_streams(engine, monkeypatch) -> list:
    seen: list = []
    real = engine.submit_n

    def recording(*args, **kwargs):
        streams = real(*args, **kwargs)
        seen.extend(streams)
        return streams

    monkeypatch.setattr(engine, "submit_n", recording)
    return seen


def test_a_client_that_disconnects_cancels_its_request(tiny, slow_steps, monkeypatch):
    seen = _recorded_streams(tiny.engine, monkeypatch)
    with tiny.client.completions.create(model="tiny", prompt="hello", max_tokens=55,
                                        temperature=0, stream=True) as stream:
        next(iter(stream))
    assert tiny.all_free()
    assert seen[0].finish_reason == "cancelled" and len(seen[0].tokens) < 55


def test_a_client_gone_while_tokens_flow_cancels_its_whole_response(tiny, slow_steps,
                                                                    monkeypatch):
    """Not streaming: the disconnect is looked for while tokens keep arriving, not only when
    the engine is idle."""
    seen = _recorded_streams(tiny.engine, monkeypatch)
    conn = http.client.HTTPConnection("127.0.0.1", tiny.live.port, timeout=WAIT_S)
    conn.request("POST", "/v1/completions", json.dumps(
        {"model": "tiny", "prompt": "hello", "max_tokens": 55, "temperature": 0}),
        {"Content-Type": "application/json"})
    deadline = time.monotonic() + WAIT_S
    while not seen or not seen[0].tokens:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    assert tiny.all_free()
    assert seen[0].finish_reason == "cancelled" and len(seen[0].tokens) < 55


def test_a_full_queue_answers_429_with_retry_after(build):
    served = Served(build("tiny", **OPTS), "tiny", max_running=1, max_waiting=1)
    gate = threading.Event()
    real = served.engine.scheduler.step
    served.engine.scheduler.step = lambda: (gate.wait(WAIT_S), real())[1]
    try:
        results: list = []
        threads = [threading.Thread(target=lambda: results.append(
            served.client.completions.create(model="tiny", prompt="a", max_tokens=3)))
            for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + WAIT_S
        while served.engine.stats()["running"] + served.engine.stats()["waiting"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as err:
            served.client.completions.create(model="tiny", prompt="a", max_tokens=3)
        assert err.value.response.headers["retry-after"] == "1"
        gate.set()
        for t in threads:
            t.join(WAIT_S)
        assert len(results) == 2 and all(r.choices[0].finish_reason == "length"
                                          for r in results)
    finally:
        gate.set()
        served.close()


def test_more_sequences_than_the_server_holds_is_a_400_not_a_429(build):
    """n continuations of each prompt past max_running + max_waiting can never be admitted:
    refused with the parameter to change, not answered "retry" on an idle server."""
    served = Served(build("tiny", **OPTS), "tiny", max_running=1, max_waiting=1)
    try:
        for body, param in ((dict(prompt="a", n=3), "n"), (dict(prompt=["a", "b", "c"]), "prompt")):
            with pytest.raises(openai.BadRequestError) as err:
                served.client.completions.create(model="tiny", max_tokens=2, **body)
            assert err.value.body["param"] == param and "at most 2" in err.value.body["message"]
        ok = served.client.completions.create(model="tiny", prompt="a", max_tokens=2, n=2)
        assert [c.finish_reason for c in ok.choices] == ["length", "length"]
        assert served.all_free()
    finally:
        served.close()


def test_requests_left_at_the_shutdown_timeout_end_with_abort(build):
    """Past --shutdown-timeout the running requests are aborted: a stream ends with an "abort"
    chunk and [DONE], a whole response comes back with finish_reason "abort"."""
    prepared = build("tiny", **OPTS)
    engine = BatchEngine.load(prepared.artifact_dir, prepared.weights_dir)
    real = engine.scheduler.runner.run
    engine.scheduler.runner.run = lambda *a: (time.sleep(0.05), real(*a))[1]
    app = create_app(engine, "tiny", owns_engine=True)
    server = draining_server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"),
                             app.state.server.abort_all, shutdown_timeout=0.3)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=WAIT_S)
        whole: list = []
        other = threading.Thread(target=lambda: whole.append(client.completions.create(
            model="tiny", prompt="b", max_tokens=55)))
        other.start()
        chunks = iter(client.completions.create(model="tiny", prompt="a", max_tokens=55,
                                                stream=True))
        first = next(chunks)
        while engine.stats()["running"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        server.should_exit = True
        rest = list(chunks)  # raises if the stream is cut instead of ended
        other.join(WAIT_S)
        thread.join(WAIT_S)
        assert not thread.is_alive() and not engine.alive  # the app closed its engine
        assert rest[-1].choices[0].finish_reason == "abort"
        text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
        assert 0 < len(engine.tokenizer.encode(text, add_bos=False)) < 55
        assert len(whole) == 1 and whole[0].choices[0].finish_reason == "abort"
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        engine.close()


def test_a_request_arriving_after_the_abort_is_refused_not_run(build):
    served = Served(build("tiny", **OPTS), "tiny")
    try:
        served.app.state.server.abort_all()
        with pytest.raises(openai.InternalServerError) as err:
            served.client.completions.create(model="tiny", prompt="a", max_tokens=40)
        assert err.value.status_code == 503 and "shutting down" in err.value.body["message"]
        assert served.all_free()
    finally:
        served.close()


def test_token_bytes_rebuild_text_that_splits_characters(tiny):
    tok = tiny.engine.tokenizer
    text = "a\u00e9\U0001F600b \u4e2d\u6587"  # one to four bytes a character
    ids = tok.encode(text, add_bos=False)
    assert len(ids) > len(text)  # the byte tokenizer splits the characters
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")


def _entries(ids):
    return [type("Entry", (), {"token": i, "logprob": -1.0, "top": ()})() for i in ids]


def test_completion_text_offsets_count_characters_not_token_pieces(tiny):
    tok = tiny.engine.tokenizer
    ids = tok.encode("a\U0001F600b", add_bos=False)  # a, the emoji's four bytes, b
    out = completion_logprobs(_entries(ids), tok, TextOffsets())
    assert out["text_offset"] == [0, 1, 1, 1, 1, 2]


def test_text_offsets_index_the_text_a_leading_space_stripped():
    """Llama 2's tokenizer decodes "▁a" first in a text as "a": offsets follow the text."""
    tok = Tokenizer(byte_fallback_backend(llama2=True), None, [], False, None)
    ids = tok.encode("a b\u00e9 a")
    text = tok.decode(ids)
    assert text == "a b\u00e9 a" and tok.token_bytes(ids[0]).startswith(b" ")
    offsets = TextOffsets()
    at = [offsets.next(tok, i, tok.token_bytes(i)) for i in ids]
    pieces = [tok.token_bytes(i).decode() for i in ids]
    pieces[0] = pieces[0].lstrip(" ")
    assert all(text[o:o + len(p)] == p for o, p in zip(at, pieces)), (at, pieces)


def test_streamed_text_offsets_equal_the_whole_responses(tiny):
    """A stop string holds text back while streaming: the offsets must not move with it."""
    kw = dict(model="tiny", prompt="hello", max_tokens=24, temperature=0, logprobs=1,
              stop=["\x00\x01\x02\x03"])
    whole = tiny.client.completions.create(**kw).choices[0]
    streamed = [c.choices[0] for c in tiny.client.completions.create(stream=True, **kw)]
    offsets = [o for c in streamed if c.logprobs for o in c.logprobs.text_offset]
    assert "".join(c.text for c in streamed) == whole.text
    assert offsets == whole.logprobs.text_offset and len(offsets) == 24


BAD = [  # (body changes, the param the error names)
    ({"model": "nope"}, "model"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 500}, "max_tokens"),
    ({"prompt": "hello " * 80}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),  # no tokens: the tiny model adds no BOS
    ({"prompt": [1, 99999]}, "prompt"),
    ({"stop": ["ok", 3]}, "stop[1]"),
    ({"stop_token_ids": [True]}, "stop_token_ids[0]"),  # not silently token 1
    ({"stop_token_ids": ["5"]}, "stop_token_ids[0]"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"stop": [""]}, "stop"),
    ({"seed": -1}, "seed"),
    ({"logprobs": 21}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),  # OpenAI's range is [-2, 2]
    ({"echo": True}, "echo"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"schema": {"type": "nonsense"}}}}, "response_format"),
]


@pytest.mark.parametrize("change,param", BAD, ids=[p for _, p in BAD])
def test_bad_completion_requests_are_400_naming_the_field(tiny, change, param):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, **change}
    with pytest.raises(openai.BadRequestError) as err:
        tiny.client.completions.create(**{k: v for k, v in body.items()
                                          if k in ("model", "prompt")},
                                       extra_body={k: v for k, v in body.items()
                                                   if k not in ("model", "prompt")})
    error = err.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert error["message"]


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("messages,extra,param", [
    ([], {}, "messages"),
    ([{"role": "robot", "content": "hi"}], {}, "messages[0].role"),
    ([{"role": "user", "content": 5}], {}, "messages[0].content"),
    ([{"role": "user", "content": "hi " * 40}], {}, "messages"),
    (HI, {"max_tokens": 500}, "max_tokens"),
    (HI, {"max_completion_tokens": 500}, "max_completion_tokens"),
    (HI, {"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    (HI, {"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
    ([{"role": "user"}], {}, "messages[0].content"),  # no content
])
def test_bad_chat_requests_are_400_naming_the_field(tiny, messages, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        tiny.client.chat.completions.create(model="tiny", messages=messages,
                                            **({"max_tokens": 4} | extra))
    assert err.value.body["param"] == param, err.value.body


def test_a_body_without_its_json_content_type_is_named(tiny):
    conn = http.client.HTTPConnection("127.0.0.1", tiny.live.port, timeout=WAIT_S)
    conn.request("POST", "/v1/completions", '{"model": "tiny", "prompt": "hi"}')
    response = conn.getresponse()
    body = json.loads(response.read())
    assert response.status == 400 and "Content-Type: application/json" in body["error"]["message"]


def test_nan_temperature_is_named_as_not_a_number(tiny):
    """Python's json (the openai client refuses NaN) writes it bare, as some clients do."""
    conn = http.client.HTTPConnection("127.0.0.1", tiny.live.port, timeout=WAIT_S)
    conn.request("POST", "/v1/completions",
                 '{"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": NaN}',
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    error = json.loads(response.read())["error"]
    assert response.status == 400 and error["param"] == "temperature", error
    assert "finite" in error["message"], error


def test_bad_json_is_a_400_with_an_openai_error_body(tiny):
    conn = http.client.HTTPConnection("127.0.0.1", tiny.live.port, timeout=WAIT_S)
    conn.request("POST", "/v1/completions", '{"model": "tiny", "prompt": ',
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    body = json.loads(resp.read())
    assert resp.status == 400 and "not valid JSON" in body["error"]["message"]


def test_chat_without_a_template_is_a_400(build):
    served = Served(build("tiny", **OPTS), "tiny")  # the tiny preset ships no chat template
    try:
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            served.client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}])
    finally:
        served.close()


def test_a_failing_request_is_a_500_and_the_others_run_on(tiny, monkeypatch):
    class Broken:
        done = False

        def allowed(self):
            raise RuntimeError("simulated grammar failure")

        def accept(self, token):
            return True

        def copy(self):
            return Broken()

    monkeypatch.setattr(type(tiny.engine.grammars), "json_schema", lambda self, schema: Broken())
    want = tiny.solo_text("the quick brown fox", 12)
    outcome = {}

    def failing():
        try:
            tiny.client.completions.create(model="tiny", prompt="x", max_tokens=20,
                                           extra_body={"response_format":
                                                       {"type": "json_object"}})
        except openai.InternalServerError as e:
            outcome["error"] = e.body

    thread = threading.Thread(target=failing)
    thread.start()
    r = tiny.client.completions.create(model="tiny", prompt="the quick brown fox",
                                       max_tokens=12, temperature=0)
    thread.join(WAIT_S)
    assert "simulated grammar failure" in outcome["error"]["message"]
    assert r.choices[0].text == want
    assert tiny.all_free()


def test_an_api_key_guards_v1_but_not_health(build):
    served = Served(build("tiny", **OPTS), "tiny", api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            served.client.models.list()
        assert served.live.client(api_key="s3cret").models.list().data[0].id == "tiny"
        conn = http.client.HTTPConnection("127.0.0.1", served.live.port, timeout=WAIT_S)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
    finally:
        served.close()


def test_metrics_count_requests_tokens_and_latencies(tiny):
    def scrape() -> dict:
        conn = http.client.HTTPConnection("127.0.0.1", tiny.live.port, timeout=WAIT_S)
        conn.request("GET", "/metrics")
        lines = conn.getresponse().read().decode().splitlines()
        return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in lines
                                          if ln and not ln.startswith("#"))}

    before = scrape()
    tiny.client.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0,
                                   n=2)
    with pytest.raises(openai.BadRequestError):
        tiny.client.completions.create(model="tiny", prompt="hello", max_tokens=0)
    after = scrape()
    ok = 'paged_decode_requests_total{endpoint="/v1/completions",status="200"}'
    bad = 'paged_decode_requests_total{endpoint="/v1/completions",status="400"}'
    assert after[ok] - before.get(ok, 0) == 1 and after[bad] - before.get(bad, 0) == 1
    assert after["paged_decode_generation_tokens_total"] - \
        before["paged_decode_generation_tokens_total"] == 12
    ttft = "paged_decode_time_to_first_token_seconds_count"
    itl = "paged_decode_inter_token_latency_seconds_count"
    assert after[ttft] - before[ttft] == 2 and after[itl] - before[itl] == 10
    for gauge in ("running_sequences", "waiting_sequences", "kv_blocks_used", "kv_blocks_total",
                  "prefix_cache_hits_total"):
        assert f"paged_decode_{gauge}" in after
    assert after["paged_decode_kv_blocks_total"] == tiny.engine.pool.num_blocks


# -- the command -------------------------------------------------------------------------------

def test_serve_refuses_a_remote_address_without_a_key(tmp_path):
    result = CliRunner().invoke(serve_cmd, ["--model", "tiny", "--host", "0.0.0.0",
                                            "--artifacts", str(tmp_path)])
    assert result.exit_code == 1 and "--api-key" in result.output
    assert not any(tmp_path.iterdir())  # refused before any compile


@pytest.mark.parametrize("args,message", [
    (["--batch-buckets", "none"], "paged-serve needs batch buckets"),
    (["--chat-template", "/nonexistent.jinja"], "--chat-template /nonexistent.jinja: cannot read"),
    (["--chat-template", "BROKEN"], r"broken\.jinja: the chat template does not parse"),
])
def test_serve_refuses_bad_options_before_compiling(tmp_path, args, message):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    root = tmp_path / "artifacts"
    args = [str(broken) if a == "BROKEN" else a for a in args]
    result = CliRunner().invoke(serve_cmd, ["--model", "tiny", "--artifacts", str(root)] + args)
    assert result.exit_code == 1 and re.search(message, result.output), result.output
    assert not root.exists() or not any(root.iterdir())  # refused before any compile


def test_a_kv_cache_too_small_for_one_block_names_the_option(build, artifact_root):
    build("tiny", **OPTS)  # found cached below; the pool is refused before serving starts
    result = CliRunner().invoke(serve_cmd, [
        "--model", "tiny", "--block-size", "4", "--max-context", "64", "--artifacts",
        str(artifact_root), "--kv-cache-gb", "0.000000001"])
    assert result.exit_code == 1, result.output
    assert "--kv-cache-gb 1e-09 is too small: " in result.output, result.output
    assert "--block-size" in result.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("grace", ["0", "30"])
def test_sigterm_during_a_stream_exits_cleanly(build, artifact_root, grace):
    build("tiny", **OPTS)  # the command below finds it cached
    port = _free_port()
    cmd = [sys.executable, "-c", "from paged_decode.cli import serve_cmd; serve_cmd()",
           "--model", "tiny", "--block-size", "4", "--max-context", "64", "--artifacts",
           str(artifact_root), "--port", str(port), "--shutdown-timeout", grace,
           "--chat-template", str(_template_file(artifact_root))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=WAIT_S)
        deadline = time.monotonic() + 120
        while True:  # the port opens at once; /health is 200 once the model is ready
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=WAIT_S).status_code \
                        == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        stream = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=30,
            stream=True)
        pieces = iter(stream)
        next(pieces)
        proc.send_signal(signal.SIGTERM)
        received = [c for c in pieces]  # ended, never cut: "abort" past the timeout
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "Traceback" not in out, err
    reason = received[-1].choices[0].finish_reason
    # time to finish: the stream ran to its end; none: aborted, unless it had already ended
    assert reason == "length" if grace == "30" else reason in ("abort", "length")


def _template_file(root) -> str:
    path = root / "chat_template.jinja"
    path.write_text(CHAT_TEMPLATE)
    return path


def test_the_load_generator_measures_a_live_server(tiny):
    from types import SimpleNamespace

    from paged_decode.bench.serve import markdown, measure, run_trace, trace_requests

    server = SimpleNamespace(name="paged-serve", url=tiny.live.url, model="tiny",
                             probe="/health")
    result = measure([server], [1, 3], per_client=2, max_tokens=5, rounds=1, say=lambda m: None)
    for c in (1, 3):
        s = result["paged-serve"][c]
        assert s["tokens_per_s"] > 0 and s["ttft_ms_p50"] > 0 and s["itl_ms_p99"] > 0
    table = markdown(result, {"model": "tiny", "paged_args": "", "max_tokens": 5,
                              "per_client": 2, "rounds": 1, "cpu": "test"})
    assert "| paged-serve | 3 |" in table
    trace = trace_requests(6, rate=50.0)
    assert len(trace) == 6 and [t[0] for t in trace] == sorted(t[0] for t in trace)
    short = [(at, prompt.split()[0], min(n, 6)) for at, prompt, n in trace]  # 64-token context
    replay = asyncio.run(run_trace(server, short))
    assert replay["tokens"] == sum(n for _, _, n in short) and len(replay["ttft"]) == 6
    assert tiny.all_free()


def test_the_default_pool_holds_the_running_sequences_within_a_memory_share(tiny, monkeypatch):
    import paged_decode.serve as serve

    manifest = tiny.engine.artifact.manifest
    assert serve.default_num_blocks(manifest, 8) == manifest.max_blocks_cap * 8
    monkeypatch.setattr(serve, "DEFAULT_KV_FRACTION", 1e-12)  # a machine with no room
    assert serve.default_num_blocks(manifest, 8) == manifest.max_blocks_cap  # one sequence
