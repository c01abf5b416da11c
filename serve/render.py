"""OpenAI response bodies: whole responses, stream chunks, usage and log-probabilities."""

from __future__ import annotations

_FINISH = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


class Choice:
    """One continuation's output as its pieces arrive."""

    def __init__(self, index: int):
        self.index = index
        self.parts: list[str] = []
        self.logprobs: list = []  # TokenLogprob entries, in order
        self.stream = None
        self.finish_reason: str | None = None
        self.offsets = TextOffsets()  # where the streamed log-probability entries begin
        self.calls = None  # a tool request's CallStream, streaming (serve/tools.py)

    def add(self, stream, delta) -> None:
        """A piece (``delta``), or the end of the stream (``None``)."""
        self.stream = stream
        if delta is None:
            self.finish_reason = _FINISH.get(stream.finish_reason, stream.finish_reason)
        else:
            self.parts.append(delta.text)
            self.logprobs.extend(delta.logprobs)

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def completion_tokens(self) -> int:
        return len(self.stream.request.tokens) if self.stream is not None else 0


def usage(job: dict, choices: list[Choice]) -> dict:
    prompt = sum(len(p) for p in job["prompts"])
    done = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _token(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token's text (U+FFFD where it holds part of a character) and its own bytes."""
    return tokenizer.decode([token_id]), list(tokenizer.token_bytes(token_id))


def chat_logprobs(entries, tokenizer) -> dict:
    content = []
    for e in entries:
        text, raw = _token(tokenizer, e.token)
        top = []
        for t, lp in e.top:
            t_text, t_raw = _token(tokenizer, t)
            top.append({"token": t_text, "logprob": lp, "bytes": t_raw})
        content.append({"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


class TextOffsets:
    """The character each of a choice's tokens begins in, token after token: the characters
    the earlier tokens' bytes complete (the second half of a split emoji starts where the emoji
    does), less a leading space the tokenizer's decoder strips from the text's start (a
    SentencePiece "▁" on the first token)."""

    def __init__(self):
        self.done, self.lead, self.first = b"", 0, True

    def next(self, tokenizer, token_id: int, raw: bytes) -> int:
        if self.first:
            self.first = False
            text = tokenizer.decode([token_id])
            self.lead = len(raw) - len(raw.lstrip(b" ")) - (len(text) - len(text.lstrip(" ")))
        at = max(len(self.done.decode("utf-8", errors="ignore")) - self.lead, 0)
        self.done += raw
        return at


def completion_logprobs(entries, tokenizer, offsets: TextOffsets) -> dict:
    """The legacy completions layout; ``offsets``: the choice's, advanced past ``entries``."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        text, raw = _token(tokenizer, e.token)
        out["tokens"].append(text)
        out["token_logprobs"].append(e.logprob)
        out["top_logprobs"].append({_token(tokenizer, t)[0]: lp for t, lp in e.top})
        out["text_offset"].append(offsets.next(tokenizer, e.token, bytes(raw)))
    return out


def _head(job: dict, chunk: bool) -> dict:
    kind = ("chat.completion" if job["chat"] else "text_completion") + \
        (".chunk" if chunk and job["chat"] else "")
    return {"id": job["id"], "object": kind, "created": job["created"], "model": job["model"]}


def _logprobs(job, entries, tokenizer, offsets: TextOffsets):
    if job["top_logprobs"] is None:
        return None
    if job["chat"]:
        return chat_logprobs(entries, tokenizer)
    return completion_logprobs(entries, tokenizer, offsets)


def render_response(job: dict, choices: list[Choice], tokenizer) -> dict:
    out = _head(job, chunk=False)
    rows = []
    for c in choices:
        lp = _logprobs(job, c.logprobs, tokenizer, TextOffsets())
        if job["chat"]:
            message, finish = _message(job, c)
            rows.append({"index": c.index, "message": message, "logprobs": lp,
                         "finish_reason": finish})
        else:
            rows.append({"index": c.index, "text": c.text, "logprobs": lp,
                         "finish_reason": c.finish_reason})
    out.update(choices=rows, usage=usage(job, choices))
    return out


def _message(job: dict, c: Choice) -> tuple[dict, str | None]:
    """A chat choice's message and finish reason; a tool request's reply split into content
    and calls (serve/tools.py)."""
    plan = job.get("tools")
    if plan is None:
        return {"role": "assistant", "content": c.text}, c.finish_reason
    content, calls = plan.split(c.text)
    message = {"role": "assistant", "content": content}
    if not calls:
        return message, c.finish_reason
    finish = c.finish_reason
    if plan.legacy:
        message["function_call"] = calls[0]["function"]
        return message, "function_call" if finish == "stop" else finish
    message["tool_calls"] = calls
    return message, "tool_calls" if finish == "stop" else finish


def render_events(job: dict, choice: Choice | None, *, tokenizer, delta=None,
                  role: bool = False, usage_of: list[Choice] | None = None) -> list[dict]:
    """The stream chunks for one event (:func:`render_chunk`'s arguments): one chunk, or for a
    tool request the content that can go out (text that may open a call is held back) and,
    at the choice's end, its calls as ``delta.tool_calls`` entries before the finish chunk."""
    plan = job.get("tools")
    if plan is None or role or usage_of is not None:
        return [render_chunk(job, choice, tokenizer=tokenizer, delta=delta, role=role,
                             usage_of=usage_of)]
    if choice.calls is None:
        choice.calls = plan.stream()
    if delta is not None:
        text = choice.calls.push(delta.text)
        if not text and not delta.logprobs:
            return []
        return [render_chunk(job, choice, tokenizer=tokenizer, delta=delta, text=text)]
    rest, calls = choice.calls.finish()
    out = [_delta_chunk(job, choice, {"content": rest})] if rest else []
    for k, call in enumerate(calls):
        fn = call["function"]
        if plan.legacy:
            out.append(_delta_chunk(job, choice, {"function_call": {"name": fn["name"],
                                                                    "arguments": ""}}))
            out.append(_delta_chunk(job, choice, {"function_call": {
                "arguments": fn["arguments"]}}))
            break
        head = {"index": k, "id": call["id"], "type": "function",
                "function": {"name": fn["name"], "arguments": ""}}
        out.append(_delta_chunk(job, choice, {"tool_calls": [head]}))
        out.append(_delta_chunk(job, choice, {"tool_calls": [
            {"index": k, "function": {"arguments": fn["arguments"]}}]}))
    if calls and choice.finish_reason == "stop":
        choice.finish_reason = "function_call" if plan.legacy else "tool_calls"
    return out + [render_chunk(job, choice, tokenizer=tokenizer)]


def _delta_chunk(job: dict, choice: Choice, delta: dict) -> dict:
    out = _head(job, chunk=True)
    out["choices"] = [{"index": choice.index, "delta": delta, "logprobs": None,
                       "finish_reason": None}]
    if job["include_usage"]:
        out["usage"] = None
    return out


def render_chunk(job: dict, choice: Choice | None, *, tokenizer, delta=None,
                 role: bool = False, usage_of: list[Choice] | None = None,
                 text: str | None = None) -> dict:
    """One stream chunk: the assistant role (``role``), a piece (``delta``; ``text`` in place
    of its text), the choice's finish (neither), or the usage of ``usage_of`` (no choice)."""
    out = _head(job, chunk=True)
    if usage_of is not None:
        out.update(choices=[], usage=usage(job, usage_of))
        return out
    row: dict = {"index": choice.index}
    if delta is None and not role:  # the choice's last chunk
        row.update({"delta": {}} if job["chat"] else {"text": ""})
        row.update(logprobs=None, finish_reason=choice.finish_reason)
    else:
        if text is None:
            text = delta.text if delta is not None else ""
        if job["chat"]:
            row["delta"] = {"role": "assistant", "content": ""} if role else {"content": text}
        else:
            row["text"] = text
        entries = delta.logprobs if delta is not None else ()
        row.update(logprobs=_logprobs(job, entries, tokenizer, choice.offsets) if entries
                   else None, finish_reason=None)
    out["choices"] = [row]
    if job["include_usage"]:
        out["usage"] = None
    return out
