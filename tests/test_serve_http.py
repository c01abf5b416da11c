"""paged-serve's HTTP conventions through a live server: the routes beside generation
(/tokenize, /detokenize, /v1/models/{id}, aliases), CORS, the API key before the body, every
error in OpenAI's ``{"error": {...}}`` shape, the prefix cache in ``usage``, a port in use, and a
fuzz of request bodies (wrong types, extreme values, junk keys): never a 5xx, never a traceback,
the server answers as before afterwards."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from paged_decode.serve.app import create_app
from paged_decode.serve.protocol import ChatRequest, CompletionRequest

from .test_serve import WAIT_S, LiveServer, _free_port, llama, tiny  # noqa: F401

KEY = "s3cret"
ORIGIN = "http://ok.example"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def gate(tiny):
    """The tiny engine behind a second app: two names, an API key, one allowed origin."""
    live = LiveServer(create_app(tiny.engine, ["tiny", "tiny-alias"], api_key=KEY,
                                 allowed_origins=[ORIGIN]))
    yield live
    live.close()


def _error(r: httpx.Response, status: int) -> dict:
    """The response's error object, checked to be OpenAI's shape with ``status``."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"], body
    return body["error"]


# -- models, aliases, tokenize ------------------------------------------------------------------

def test_models_lists_every_alias_and_each_has_its_card(gate):
    listed = httpx.get(gate.url + "/v1/models", headers=AUTH, timeout=WAIT_S).json()
    assert [m["id"] for m in listed["data"]] == ["tiny", "tiny-alias"]
    for name in ("tiny", "tiny-alias"):
        card = httpx.get(f"{gate.url}/v1/models/{name}", headers=AUTH, timeout=WAIT_S).json()
        assert card["id"] == name and card["object"] == "model"
        assert card["structured_output"] == {"available": True, "reason": None}
    r = httpx.post(gate.url + "/v1/completions", headers=AUTH, timeout=WAIT_S,
                   json={"model": "tiny-alias", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "tiny-alias"


def test_an_unknown_model_id_is_a_404_in_openais_shape(gate):
    r = httpx.get(gate.url + "/v1/models/gpt-5", headers=AUTH, timeout=WAIT_S)
    error = _error(r, 404)
    assert error["type"] == "not_found_error" and "'tiny'" in error["message"]


def test_tokenize_and_detokenize_round_trip_as_transformers_tokenizes(llama, llama_ckpt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(llama_ckpt.path)
    text = "the quick brown fox, hello"
    url = llama.live.url

    def tokenize(**body):
        r = httpx.post(url + "/tokenize", json=body, timeout=WAIT_S)
        assert r.status_code == 200, r.text
        return r.json()

    vllm = tokenize(model=llama.name, prompt=text)
    assert vllm["tokens"] == hf(text)["input_ids"] and vllm["count"] == len(vllm["tokens"])
    assert vllm["max_model_len"] == 64
    bare = tokenize(prompt=text, add_special_tokens=False)["tokens"]
    assert bare == hf(text, add_special_tokens=False)["input_ids"]
    assert tokenize(content=text, add_special=False)["tokens"] == bare  # llama-server's
    pieces = tokenize(content=text, add_special=False, with_pieces=True)["tokens"]
    assert [p["id"] for p in pieces] == bare and "".join(p["piece"] for p in pieces) == text
    strs = tokenize(prompt=text, add_special_tokens=False, return_token_strs=True)["token_strs"]
    assert strs == hf.convert_ids_to_tokens(bare)
    chat = tokenize(messages=[{"role": "user", "content": text}])["tokens"]
    rendered = hf.apply_chat_template([{"role": "user", "content": text}],
                                      add_generation_prompt=True, tokenize=False)
    assert chat == hf(rendered, add_special_tokens=False)["input_ids"]
    back = httpx.post(url + "/detokenize", json={"tokens": bare}, timeout=WAIT_S).json()
    assert back == {"prompt": text, "content": text}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "a", "content": "b"}, "content"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens[1]"),
    ("/detokenize", {"tokens": [True]}, "tokens[0]"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
])
def test_bad_tokenize_requests_name_their_field(tiny, path, body, param):
    r = httpx.post(tiny.live.url + path, json=body, timeout=WAIT_S)
    assert _error(r, 400)["param"] == param


def test_a_repeated_long_prompt_reports_its_cached_tokens(tiny):
    prompt = "the quick brown fox jumps over the lazy dog "
    first = tiny.client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    again = tiny.client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens == len(prompt)  # the tiny model's ids are its bytes
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < len(prompt) and cached % tiny.engine.pool.block_size == 0
    stream = tiny.client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                            stream=True, stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens == cached


# -- CORS and the API key -----------------------------------------------------------------------

def _preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(url + "/v1/chat/completions", timeout=WAIT_S, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_a_cors_preflight_answers_without_the_key_for_an_allowed_origin(gate, tiny):
    ok = _preflight(gate.url, ORIGIN)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    other = _preflight(gate.url, "http://evil.example")
    assert other.status_code >= 400 and "access-control-allow-origin" not in other.headers
    plain = _preflight(tiny.live.url, ORIGIN)  # a server without --allowed-origins
    assert "access-control-allow-origin" not in plain.headers
    _error(plain, 405)
    call = httpx.post(gate.url + "/v1/completions", headers=AUTH | {"Origin": ORIGIN},
                      json={"model": "tiny", "prompt": "hi", "max_tokens": 1}, timeout=WAIT_S)
    assert call.status_code == 200 and call.headers["access-control-allow-origin"] == ORIGIN


@pytest.mark.parametrize("body", [b'{"model": ', b"[" * 100_000, b'{"prompt": "\xff"}',
                                  b'{"model": "tiny", "prompt": 5}', b"x" * 100])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_the_key_is_checked_before_the_body(gate, path, body):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(gate.url + path, content=body, headers=JSON | headers, timeout=WAIT_S)
        assert _error(r, 401)["type"] == "authentication_error"


# -- every error in OpenAI's shape --------------------------------------------------------------

def _deep_schema_body(levels: int) -> bytes:
    """A request whose JSON schema nests ``levels`` objects (written as text: Python's json
    recurses per level)."""
    schema = '{"type": "object", "properties": {"a": ' * levels + '{"type": "string"}' \
        + "}}" * levels
    return (f'{{"model": "tiny", "prompt": "x", "response_format": {{"type": "json_schema", '
            f'"json_schema": {{"schema": {schema}}}}}}}').encode()


ERRORS = [  # (method, path, body, status, words the message holds)
    ("GET", "/nope", None, 404, "no such route"),
    ("GET", "/v1/completions", None, 405, "method"),
    ("PUT", "/v1/models", None, 405, "method"),
    ("POST", "/v1/completions", b'{"model": ', 400, "not valid JSON"),
    ("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "nests 100000 levels"),
    ("POST", "/v1/completions", b"{" * 100_000, 400, "nests"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "\\ud800"}', 400, "surrogate"),
    ("POST", "/v1/completions", b'["model"]', 400, "JSON object"),
    ("POST", "/v1/completions", _deep_schema_body(3000), 400, "nests 6004 levels"),
    ("POST", "/v1/chat/completions", b'{"model": "tiny", "messages": "hi"}', 400, "messages"),
]


@pytest.mark.parametrize("method,path,body,status,words", ERRORS,
                         ids=[f"{m} {p} {s} {w}" for m, p, _, s, w in ERRORS])
def test_every_error_is_in_openais_shape(tiny, method, path, body, status, words):
    r = httpx.request(method, tiny.live.url + path, content=body, headers=JSON, timeout=WAIT_S)
    assert words in _error(r, status)["message"]


def test_a_body_past_the_limit_is_a_413_before_it_is_read(tiny):
    from paged_decode.serve.body import MAX_BODY_BYTES

    big = b'{"model": "tiny", "prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    r = httpx.post(tiny.live.url + "/v1/completions", content=big, headers=JSON,
                   timeout=WAIT_S)
    assert "larger than" in _error(r, 413)["message"]

    def chunks():  # no Content-Length: counted while it streams in
        yield big[:1000]
        yield big[1000:]

    r = httpx.post(tiny.live.url + "/v1/completions", content=chunks(), headers=JSON,
                   timeout=WAIT_S)
    _error(r, 413)


def test_a_port_in_use_is_one_error_line_and_status_1(tmp_path):
    import socket

    port = _free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen(1)
        proc = subprocess.run(
            [sys.executable, "-c", "from paged_decode.cli import serve_cmd; serve_cmd()",
             "--model", "tiny", "--port", str(port), "--artifacts", str(tmp_path / "a")],
            capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 1, (proc.returncode, out)
    assert len(errors) == 1 and f":{port} (" in errors[0] and "--port" in errors[0], out
    assert "Traceback" not in out and "listening on" not in out, out
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").iterdir())


# -- the field table ----------------------------------------------------------------------------

def _fields(model) -> set[str]:
    return {info.alias or name for name, info in model.model_fields.items()}


def test_docs_table_lists_every_request_field():
    doc = (Path(__file__).parent.parent / "docs" / "serving.md").read_text()
    section = doc.split("## Request fields", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    named = {m for line in rows for m in re.findall(r"`([a-z_]+)`", line.split("|")[1])}
    missing = (_fields(CompletionRequest) | _fields(ChatRequest)) - named
    assert not missing, f"docs/serving.md's request field table lacks {sorted(missing)}"
    for line in rows:
        assert re.search(r"\| (honoured|ignored|refused)", line), line


# -- fuzz ---------------------------------------------------------------------------------------

_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.sampled_from([0, 1, -1, 2**63]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e308, -0.0, 0.5, 1.0]),
    st.text(max_size=12), st.sampled_from(["", "auto", "text", "json_object", "\x00", "é"]))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8)


@st.composite
def _bodies(draw):
    chat = draw(st.booleans())
    body = ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]} if chat
            else {"model": "tiny", "prompt": "hi"})
    body["max_tokens"] = 3
    fields = sorted(_fields(ChatRequest if chat else CompletionRequest))
    for name in draw(st.lists(st.sampled_from(fields), max_size=3, unique=True)):
        body[name] = draw(_VALUES)
    for _ in range(draw(st.integers(0, 1))):
        body[draw(st.text(min_size=1, max_size=10))] = draw(_VALUES)
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 8)  # bounded: the fuzz is of the fields
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


class _Failures(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        if record.exc_info or record.levelno >= logging.ERROR:
            self.records.append(record)


def test_fuzzed_bodies_get_a_200_or_a_4xx_and_no_traceback(tiny):
    before = tiny.client.completions.create(model="tiny", prompt="the quick", max_tokens=8,
                                            temperature=0).choices[0].text
    failures = _Failures()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn"),
               logging.getLogger("uvicorn.error")]
    for logger in loggers:
        logger.addHandler(failures)
    client = httpx.Client(base_url=tiny.live.url, timeout=WAIT_S)
    statuses: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow])
    @given(_bodies())
    def one(case):
        path, body = case
        r = client.post(path, content=json.dumps(body), headers=JSON)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if r.status_code != 200:
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
            _error(r, r.status_code)
        assert not failures.records, (body, failures.records[0].getMessage())

    try:
        one()
    finally:
        client.close()
        for logger in loggers:
            logger.removeHandler(failures)
    after = tiny.client.completions.create(model="tiny", prompt="the quick", max_tokens=8,
                                           temperature=0).choices[0].text
    assert after == before
    assert statuses.get(200, 0) >= 10 and statuses.get(400, 0) >= 10, statuses  # both reached
    assert tiny.all_free()
