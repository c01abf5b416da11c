"""``paged-run --chat`` without ``--prompt``: a conversation in the terminal.

Each turn renders the whole history with the model's chat template and generates the reply;
Ctrl-C stops the reply being written (the part written so far stays in the history) and the
conversation goes on; ``/exit`` (or end of input) ends it, ``/clear`` forgets the history.
When a turn would not fit the artifact's context, the oldest turns are dropped (and said so).
"""

from __future__ import annotations

import contextlib
from typing import Callable

from paged_decode.runtime.errors import CapacityError, InputError

HELP = "/exit ends the conversation, /clear forgets it; Ctrl-C stops a reply"


def _fit(tokenizer, history: list[dict], room: int, say) -> list[int]:
    """The rendered history as ids, dropping the oldest exchanges until it fits ``room``."""
    dropped = 0
    while True:
        ids = tokenizer.encode(tokenizer.apply_chat_template(history), add_bos=False)
        if len(ids) <= room or len(history) <= 1:
            break
        del history[:2]  # a user message and the reply to it
        dropped += 1
    if dropped:
        say(f"(the oldest {dropped} exchange(s) no longer fit the context and were dropped)")
    if len(ids) > room:
        del history[:]
        raise CapacityError(f"this message is {len(ids)} tokens with the template and the "
                            f"context leaves {room}; shorten it (or build a longer --max-context)")
    return ids


def chat_loop(engine, *, max_new_tokens: int, sampling, read: Callable[[str], str],
              write: Callable[[str], None], say: Callable[[str], None]) -> int:
    """Run the conversation until ``/exit`` or end of input (``read`` raises EOFError);
    returns the number of replies.  ``write`` takes reply text, ``say`` a line for the user."""
    tokenizer = engine.tokenizer
    if tokenizer is None or tokenizer.chat_template is None:
        raise InputError("this model has no chat template: give a plain prompt with --prompt")
    room = engine.artifact.max_tokens - max(max_new_tokens - 1, 0)
    history: list[dict] = []
    replies = 0
    say(HELP)
    while True:
        try:
            line = read(">>> ").strip()
        except EOFError:
            write("\n")
            return replies
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell does
            write("\n")
            continue
        if line in ("/exit", "/quit", "/bye"):
            return replies
        if line == "/clear":
            history.clear()
            say("(history cleared)")
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        try:
            ids = _fit(tokenizer, history, room, say)
        except (CapacityError, InputError) as e:
            say(f"error: {e}")
            history.clear()
            continue
        history.append({"role": "assistant", "content": _reply(engine, ids, max_new_tokens,
                                                                 sampling, write, say)})
        replies += 1


def _reply(engine, ids, max_new_tokens, sampling, write, say) -> str:
    """Stream one reply; Ctrl-C ends it early (the generation is closed, its blocks freed)."""
    pieces = []
    stream = engine.stream_ids_text(ids, max_new_tokens=max_new_tokens, sampling=sampling)
    try:
        with contextlib.closing(stream):
            for piece in stream:
                pieces.append(piece)
                write(piece)
    except KeyboardInterrupt:
        write("\n")
        say("(stopped)")
        return "".join(pieces)
    write("\n")
    return "".join(pieces)
