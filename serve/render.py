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
            rows.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "logprobs": lp, "finish_reason": c.finish_reason})
        else:
            rows.append({"index": c.index, "text": c.text, "logprobs": lp,
                         "finish_reason": c.finish_reason})
    out.update(choices=rows, usage=usage(job, choices))
    return out


def render_chunk(job: dict, choice: Choice | None, *, tokenizer, delta=None,
                 role: bool = False, usage_of: list[Choice] | None = None) -> dict:
    """One stream chunk: the assistant role (``role``), a piece (``delta``), the choice's
    finish (neither), or the usage of ``usage_of`` (no choice)."""
    out = _head(job, chunk=True)
    if usage_of is not None:
        out.update(choices=[], usage=usage(job, usage_of))
        return out
    row: dict = {"index": choice.index}
    if delta is None and not role:  # the choice's last chunk
        row.update({"delta": {}} if job["chat"] else {"text": ""})
        row.update(logprobs=None, finish_reason=choice.finish_reason)
    else:
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
