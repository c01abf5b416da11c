"""The chat page at ``/`` in a real browser: headless Chromium (Debian's package) driven over
its DevTools protocol against a live paged-serve on 127.0.0.1.  A prompt is typed and sent, the
streamed reply shows up, and the stop button ends both the reply and the server's request.
Every wait is bounded."""

from __future__ import annotations

import base64
import itertools
import json
import queue
import re
import shutil
import subprocess
import threading
import time

import httpx
import pytest
import websocket

from .test_serve import WAIT_S, _recorded_streams, tiny  # noqa: F401 (the fixture)

CHROMIUM = shutil.which("chromium")
# skipped before any fixture, so a machine without the browser builds and loads nothing here
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no `chromium` binary on PATH: the chat page test needs headless "
    "Chromium (Debian's `chromium` package, which .ci/run installs)")

PROMPT = "hello"
STEP_S = 0.1  # each engine step lasts at least this, so a 34-token reply outlives the stop click


@pytest.fixture
def slow_steps(tiny, monkeypatch):
    runner = tiny.engine.scheduler.runner
    real = runner.run

    def slow(*args):
        time.sleep(STEP_S)
        return real(*args)

    monkeypatch.setattr(runner, "run", slow)


class Browser:
    """A headless Chromium with one page, spoken to over the DevTools protocol."""

    def __init__(self, binary: str, profile) -> None:
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--remote-debugging-port=0", f"--user-data-dir={profile}", "--window-size=1100,760",
             "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True)
        self.ids = itertools.count(1)
        try:
            port = self._devtools_port()
            self.ws = websocket.create_connection(self._page_socket(port), timeout=WAIT_S,
                                                  suppress_origin=True)
        except BaseException:
            self.close()
            raise

    def _devtools_port(self) -> int:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stderr],
                         daemon=True).start()
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            found = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
            if found:
                return int(found.group(1))
        raise RuntimeError("Chromium did not print its DevTools address")

    @staticmethod
    def _page_socket(port: int) -> str:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=WAIT_S).json()
            pages = [t for t in targets if t["type"] == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
            time.sleep(0.05)
        raise RuntimeError("Chromium opened no page")

    def send(self, method: str, **params) -> dict:
        call = next(self.ids)
        self.ws.send(json.dumps({"id": call, "method": method, "params": params}))
        while True:  # events in between are not needed here
            reply = json.loads(self.ws.recv())
            if reply.get("id") == call:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def eval(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str):
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.05)
        log = self.eval("document.getElementById('log').innerText")
        pytest.fail(f"the page never showed {what} within {WAIT_S} s; it shows: {log!r}")

    def open(self, url: str) -> None:
        self.send("Page.enable")
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && !!document.getElementById('send')",
                      "the loaded chat page")

    def click(self, element_id: str) -> None:
        """A real mouse click in the middle of the element."""
        x, y = self.eval(f"(() => {{ const r = document.getElementById('{element_id}')"
                         ".getBoundingClientRect(); return [r.x + r.width / 2, "
                         "r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left",
                      clickCount=1)

    def type_into(self, element_id: str, text: str) -> None:
        self.click(element_id)
        self.send("Input.insertText", text=text)

    def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            self.send("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                      windowsVirtualKeyCode=13, text="\r" if kind == "keyDown" else "")

    def set_value(self, element_id: str, value: str) -> None:
        self.eval(f"document.getElementById('{element_id}').value = {json.dumps(value)}")

    def screenshot(self, path) -> None:
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot")["data"]))
        print(f"chat page screenshot: {path}")

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(WAIT_S)


@pytest.fixture
def browser(tmp_path):
    b = Browser(CHROMIUM, tmp_path / "profile")
    yield b
    b.close()


REPLIES = "Array.from(document.querySelectorAll('#log .assistant'), d => d.textContent)"
LAST_REPLY = "Array.from(document.querySelectorAll('#log .assistant')).pop()"


def test_the_chat_page_streams_a_reply_and_stop_ends_the_request(tiny, browser, tmp_path,
                                                                  slow_steps, monkeypatch):
    browser.open(tiny.live.url + "/")
    assert browser.eval("document.getElementById('model').textContent") == "tiny"
    assert "tiny" in browser.eval("document.title")

    # greedy, so the page's reply is the model's own reply to the prompt run alone
    browser.set_value("temperature", "0")
    browser.set_value("max_tokens", "8")
    browser.type_into("prompt", PROMPT)
    browser.press_enter()
    browser.wait_for(f"{LAST_REPLY} && {LAST_REPLY}.dataset.finish", "a finished reply")
    assert browser.eval(REPLIES) == [tiny.solo_text(PROMPT, 8, chat=True)]
    assert browser.eval(f"{LAST_REPLY}.dataset.finish") in ("length", "stop")
    stats = browser.eval("document.querySelector('#log .stats').textContent")
    assert re.search(r"time to first token \d+ ms", stats), stats
    usage = tiny.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
        temperature=0).usage
    count = usage.completion_tokens  # the page counts the server's tokens, not its deltas
    assert stats.startswith(f"{count} token{'s' if count > 1 else ''} · "), stats
    assert (re.search(r"[\d.]+ tokens/s", stats) is not None) == (count > 1), stats
    assert tiny.all_free()

    # the conversation so far plus a second turn outgrows the 64-token context: the server's
    # 400 is shown as the reply, and the send button works again
    browser.type_into("prompt", PROMPT)
    browser.press_enter()
    browser.wait_for(f"{LAST_REPLY}.dataset.finish === 'error'", "the refused turn")
    assert "context" in browser.eval(f"{LAST_REPLY}.textContent")
    assert browser.eval("document.getElementById('send').disabled") is False

    # a new conversation, and a longer reply stopped once it has begun to stream
    browser.click("clear")
    assert browser.eval(REPLIES) == []
    seen = _recorded_streams(tiny.engine, monkeypatch)
    browser.set_value("max_tokens", "34")
    browser.type_into("prompt", PROMPT)
    browser.click("send")
    browser.wait_for(f"{LAST_REPLY} && {LAST_REPLY}.textContent.length > 0",
                     "the reply streaming")
    browser.click("stop")
    browser.wait_for(f"{LAST_REPLY}.dataset.finish", "the reply's end")
    assert browser.eval(f"{LAST_REPLY}.dataset.finish") == "stopped", browser.eval(REPLIES)
    assert tiny.all_free()  # the server's request ended: nothing runs, every block is free
    assert len(seen) == 1, browser.eval(REPLIES)
    assert seen[0].finish_reason == "cancelled" and len(seen[0].tokens) < 34
    stopped = browser.eval(f"{LAST_REPLY}.textContent")
    time.sleep(0.3)  # the reply does not grow after the stop
    assert browser.eval(f"{LAST_REPLY}.textContent") == stopped
    assert browser.eval("document.getElementById('send').disabled") is False
    loaded = browser.eval("[location.href].concat(performance.getEntriesByType('resource')"
                          ".map(e => e.name))")
    assert loaded and all(url.startswith(tiny.live.url + "/") for url in loaded), loaded
    browser.screenshot(tmp_path / "chat_page.png")


def test_the_chat_page_sends_its_system_prompt_and_sampling_settings(tiny, browser,
                                                                     monkeypatch):
    calls: list = []
    real = tiny.engine.submit_n

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(tiny.engine, "submit_n", recording)
    browser.open(tiny.live.url + "/")
    settings = {"system": "brief", "temperature": "0.5", "top_p": "0.9", "top_k": "5",
                "max_tokens": "6", "seed": "7"}
    for element_id, value in settings.items():
        browser.set_value(element_id, value)
    browser.type_into("prompt", PROMPT)
    browser.press_enter()
    browser.wait_for(f"{LAST_REPLY} && {LAST_REPLY}.dataset.finish", "a finished reply")
    assert browser.eval(f"{LAST_REPLY}.dataset.finish") in ("length", "stop")

    tok = tiny.engine.tokenizer
    messages = [{"role": "system", "content": "brief"}, {"role": "user", "content": PROMPT}]
    (args, kwargs), = calls
    assert list(args[0]) == tok.encode(tok.apply_chat_template(messages), add_bos=False)
    assert kwargs["max_new_tokens"] == 6
    sampling = kwargs["sampling"]
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed) == \
        (0.5, 0.9, 5, 7)
    assert tiny.all_free()
