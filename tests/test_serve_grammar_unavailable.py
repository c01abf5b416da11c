"""A model whose tokenizer llguidance cannot index (a WordPiece decoder): the server decides it
once, at the first request that needs a grammar or the first model card (not at start: the index
of a large vocabulary costs a start 0.3 s and 50 MiB), says so once in its log, and /v1/models
says so too; a request asking for it is a 400 naming the field and the reason; every other
request runs as on any model."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from paged_decode.runtime.grammar import GrammarUnavailableError
from paged_decode.serve.app import create_app
from paged_decode.serve.protocol import APIError, ChatRequest
from paged_decode.serve.tools import tool_plan

from .conftest import CHAT_TEMPLATE, _shared_dir
from .test_serve import OPTS, WAIT_S, Served, _free_port


def _wordpiece_tokenizer():
    """A trained WordPiece tokenizer (BERT's decoder), ids 0 = <s>, 1 = </s> as the random
    Llama's config has them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "[UNK]"],
                                        show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog, hello"] * 8, trainer)
    return tok


@pytest.fixture(scope="module")
def wordpiece(build, llama_ckpt, tmp_path_factory):
    """The random Llama's weights and config beside a WordPiece tokenizer, in a folder named
    as the Llama's (an artifact's name is its model's folder name and its key): its compiled
    artifact is reused."""
    from transformers import PreTrainedTokenizerFast

    def write(path):
        (path / llama_ckpt.path.name).mkdir()
        for name in ("config.json", "model.safetensors"):
            shutil.copy(llama_ckpt.path / name, path / llama_ckpt.path.name / name)
        PreTrainedTokenizerFast(tokenizer_object=_wordpiece_tokenizer(), bos_token="<s>",
                                eos_token="</s>", unk_token="[UNK]").save_pretrained(
                                    path / llama_ckpt.path.name)

    path = _shared_dir(tmp_path_factory, "llama_wordpiece", write) / llama_ckpt.path.name
    logger = logging.getLogger("paged_decode.serve.app")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        served = Served(build(path, **OPTS), "wordpiece", chat_template=CHAT_TEMPLATE)
        served.log = records  # the app's log records, from its creation on
        served.path = path
        yield served
        served.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def _said(served) -> list[str]:
    return [m for m in (r.getMessage() for r in served.log) if "structured output" in m]


def _post(served, path, body) -> httpx.Response:
    return httpx.post(served.live.url + path, json=body, timeout=WAIT_S)


def test_the_log_and_the_model_card_say_structured_output_is_unavailable(wordpiece):
    for _ in range(2):  # decided at the first card, said once
        card = httpx.get(wordpiece.live.url + "/v1/models", timeout=WAIT_S).json()["data"][0]
        assert card["structured_output"]["available"] is False
        assert "WordPiece" in card["structured_output"]["reason"]
    said = _said(wordpiece)
    assert len(said) == 1 and "unavailable" in said[0] and "WordPiece" in said[0], said
    with pytest.raises(GrammarUnavailableError, match="llguidance cannot index"):
        wordpiece.engine.grammars


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object"}}}}, "response_format"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"guided_choice": ["yes", "no"]}, "guided_choice"),
    ({"guided_regex": "[a-z]+"}, "guided_regex"),
])
def test_a_structured_request_is_a_400_naming_the_field_and_the_reason(wordpiece, extra, param):
    for _ in range(2):  # decided once at start: the same answer, never a retried failure
        r = _post(wordpiece, "/v1/completions",
                  {"model": "wordpiece", "prompt": "hello", "max_tokens": 4} | extra)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param, r.text
        assert "not available for this model's tokenizer" in error["message"], error


def test_an_app_decides_at_first_need_not_at_creation(wordpiece):
    """Creating the app builds no grammar index and logs nothing about it; its first model
    card decides (the engine keeps what it built, each app says it once)."""
    before = len(_said(wordpiece))
    app = create_app(wordpiece.engine, "wordpiece")
    assert len(_said(wordpiece)) == before
    card = app.state.server.model_card("wordpiece")
    assert card["structured_output"]["available"] is False
    app.state.server.model_card("wordpiece")
    assert len(_said(wordpiece)) == before + 1


def test_other_requests_are_untouched(wordpiece):
    want = wordpiece.solo_text("the quick brown fox", 8)
    r = _post(wordpiece, "/v1/completions", {"model": "wordpiece", "prompt": "the quick brown fox",
                                             "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
    chat = _post(wordpiece, "/v1/chat/completions", {
        "model": "wordpiece", "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4})
    assert chat.status_code == 200, chat.text
    assert wordpiece.all_free()


def test_tool_calls_name_the_reason_too(wordpiece):
    """Forced tool calls need the grammar: a 400 with the reason (checked on the plan, as the
    64-token test context cannot hold a tool prompt)."""
    body = ChatRequest.model_validate({
        "model": "wordpiece", "messages": [{"role": "user", "content": "hello"}],
        "tool_choice": "required", "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object"}}}]}, strict=True)
    plan = tool_plan(body, wordpiece.engine.tokenizer, None)
    with pytest.raises(APIError) as err:
        asyncio.run(plan.constraint(wordpiece.engine))
    assert err.value.status == 400 and "not available" in err.value.message
    assert err.value.param == "tool_choice" and "parameters" not in err.value.message


def test_paged_serve_says_so_in_its_log_and_models(wordpiece, artifact_root):
    """The command's app decides at the first model card as any app does."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-c", "from paged_decode.cli import serve_cmd; serve_cmd()",
           "--model", str(wordpiece.path), "--block-size", "4", "--max-context", "64",
           "--artifacts", str(artifact_root), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:  # the port opens at once; /health is 200 once the model is ready
            try:
                if httpx.get(url + "/health", timeout=WAIT_S).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.2)
        card = httpx.get(url + "/v1/models", timeout=WAIT_S).json()["data"][0]
        r = httpx.post(url + "/v1/completions", timeout=WAIT_S, json={
            "model": card["id"], "prompt": "hello", "max_tokens": 2,
            "response_format": {"type": "json_object"}})
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        proc.kill()
    assert card["structured_output"]["available"] is False, card
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    said = [line for line in (out + err).splitlines() if "structured output" in line]
    assert len(said) == 1 and "unavailable" in said[0], out + err
