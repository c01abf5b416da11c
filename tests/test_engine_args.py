"""BatchEngine.submit takes nothing on trust: each argument of the wrong kind is an InputError
naming it, raised before anything is queued; no wait on a stream can last forever."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from paged_decode.runtime.batch_engine import BatchEngine
from paged_decode.runtime.errors import EngineStoppedError, InputError

from .conftest import BUCKETS

OPTS = dict(block_size=4, max_context=64, batch_buckets=BUCKETS)


@pytest.fixture(scope="module")
def batch(build):
    prepared = build("tiny", **OPTS)
    with BatchEngine.load(prepared.artifact_dir, prepared.weights_dir) as engine:
        yield engine


def _within(fn, seconds: float = 60):
    """``fn()``'s result (or the exception it raised), or ``TimeoutError`` if it had not
    returned within ``seconds``."""
    out: list = []

    def run():
        try:
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            out.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return out[0] if out else TimeoutError(f"{fn} still waiting after {seconds} s")


class _NotAConstraint:
    def allowed(self):
        return None


BAD = {
    "prompt_bytes": ((b"w5 w6",), {}, r"prompt=b'w5 w6' is bytes.*decode it"),
    "prompt_bytearray": ((bytearray(b"ab"),), {}, r"prompt=b'ab' is bytes"),
    "prompt_dict": (({1: 2},), {}, r"text or a list of token ids, got dict"),
    "prompt_set": (({1, 2},), {}, r"text or a list of token ids, got set"),
    "prompt_float_ids": (([5.0, 6.0],), {}, r"token ids must be integers"),
    "prompt_bool_ids": (([True, False],), {}, r"token ids must be integers"),
    "constraint_str": (("hi",), {"constraint": "x"}, r"constraint='x': must be a TokenConstraint"),
    "constraint_partial": (("hi",), {"constraint": _NotAConstraint()},
                           r"constraint=.*must be a TokenConstraint"),
    "listener_int": (("hi",), {"listener": 5}, r"listener=5: must be a callable"),
    "sampling_dict": (("hi",), {"sampling": {"temperature": 0}},
                      r"sampling=\{'temperature': 0\}: must be a SamplingParams"),
    "chat_str": (("hi",), {"chat": "yes"}, r"chat='yes': must be True or False"),
    "stop_int": (("hi",), {"stop": 5}, r"stop=5: must be a list of non-empty strings"),
    "stop_ids_bytes": (("hi",), {"stop_token_ids": b"ab"}, r"stop_token_ids"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_bad_argument_is_refused_at_submit_naming_it(batch, case):
    args, kwargs, match = BAD[case]
    before = batch.stats()
    with pytest.raises(InputError, match=match):
        batch.submit(*args, **kwargs)
    after = batch.stats()
    assert (after["running"], after["waiting"], after["blocks_used"]) == (
        before["running"], before["waiting"], before["blocks_used"])
    assert batch.alive


def test_text_of_a_stream_with_a_listener_returns_when_it_ends(batch):
    """The pieces go to the listener; ``text()`` still ends, with the same text, and iterating
    the stream is an error saying where the pieces went."""
    pieces: list = []
    stream = batch.submit("paged", max_new_tokens=8, listener=lambda s, d: pieces.append(d))
    text = _within(stream.text)
    assert isinstance(text, str), text
    assert text == "".join(d.text for d in pieces if d is not None)
    assert text == batch.submit("paged", max_new_tokens=8).text()
    assert pieces[-1] is None and stream.finish_reason == "length"
    with pytest.raises(InputError, match="has a listener"):
        next(iter(stream))


def test_a_wait_ends_when_the_engine_thread_dies(build, monkeypatch):
    """Whatever stops the engine's thread, every stream still open ends with an
    EngineStoppedError: text() and iteration return instead of waiting forever."""
    prepared = build("tiny", **OPTS)
    engine = BatchEngine.load(prepared.artifact_dir, prepared.weights_dir)
    try:
        stop = threading.Event()

        def step():
            stop.wait(60)
            raise SystemExit("the engine's thread is gone")  # not an Exception: not caught
        monkeypatch.setattr(engine.scheduler, "step", step)
        plain = engine.submit("hello", max_new_tokens=4)
        heard = engine.submit("hello", max_new_tokens=4, listener=lambda s, d: None)
        stop.set()
        for wait in (plain.text, heard.text):
            error = _within(wait)
            assert isinstance(error, EngineStoppedError), error
        deadline = time.monotonic() + 10  # the thread ends the streams, then returns
        while engine.alive and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.alive
        with pytest.raises(EngineStoppedError):
            engine.submit("hello")
    finally:
        engine.close()


def test_token_id_prompts_still_run(batch):
    ids = batch.tokenizer.encode_prompt("paged", False)
    assert batch.submit(np.asarray(ids), max_new_tokens=4).text() == \
        batch.submit(ids, max_new_tokens=4).text()
