"""Text in, text out for many requests at once: the scheduler on a thread of its own.

``BatchEngine.submit`` queues a request and returns a :class:`RequestStream` at once; the
engine's thread admits it at its next step, and the stream yields text pieces as tokens arrive
(``cancel()`` ends it at the next step and frees its blocks).  ``generate_many`` submits a list
and waits for all.  Stop strings are matched on the decoded text: the text up to the first stop
string is returned, the stop string is not, and text that could still begin a stop string is
held back until it cannot.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Iterator, Sequence

from .artifact import Artifact, WeightPack, load_artifact, load_weights
from .errors import InputError
from .kv_pool import PagedKVCache
from .sampling import SamplingParams
from .scheduler import Request, Scheduler
from .tokenizer import Tokenizer

_END = object()


class RequestStream:
    """One submitted request: iterate it for text pieces; ``text()`` waits for all of it."""

    def __init__(self, engine: "BatchEngine", req: Request, stops: tuple[str, ...]):
        self._engine, self.request, self._stops = engine, req, stops
        self._pieces: queue.Queue = queue.Queue()
        self._decoder = engine.tokenizer.stream(skip_special_tokens=True)
        self._text, self._sent = "", 0  # decoded so far, and how much of it was handed out
        self.error: BaseException | None = None
        self.finish_reason: str | None = None

    # called on the engine's thread -------------------------------------------------------------
    def _push(self, token: int) -> bool:
        """Add a token's text; True when a stop string ended the request."""
        if token not in self.request.stop_ids:
            self._text += self._decoder.push(token)
        cut = min((i for i in (self._text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._text = self._text[:cut]
            self._send(len(self._text))
            return True
        hold = max((len(s) - 1 for s in self._stops), default=0)
        self._send(max(self._sent, len(self._text) - hold))
        return False

    def _send(self, upto: int) -> None:
        if upto > self._sent:
            self._pieces.put(self._text[self._sent:upto])
            self._sent = upto

    def _close(self, reason: str | None, error: BaseException | None = None) -> None:
        if error is None and reason != "stop":
            self._text += self._decoder.flush()
        self._send(len(self._text))
        self.finish_reason, self.error = reason, error
        self._pieces.put(_END)

    # called by the user ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[str]:
        while True:
            piece = self._pieces.get()
            if piece is _END:
                self._pieces.put(_END)  # a second iteration ends at once
                if self.error is not None:
                    raise self.error
                return
            yield piece

    def text(self) -> str:
        """The whole completion (waits for the request to finish)."""
        return "".join(self)

    def cancel(self) -> None:
        """End the request at the engine's next step (its blocks are freed there)."""
        self._engine._inbox.put(("cancel", self))

    @property
    def tokens(self) -> list[int]:
        return list(self.request.tokens)


class BatchEngine:
    """Continuous batching over one artifact: many requests, one pool, one scheduler thread.

    Thread safety: ``submit`` / ``cancel`` / ``generate_many`` may be called from any thread;
    the model runs only on the engine's thread.
    """

    def __init__(self, artifact: Artifact, weights: WeightPack, pool: PagedKVCache,
                 tokenizer: Tokenizer, **scheduler_options):
        self.artifact, self.weights, self.pool, self.tokenizer = artifact, weights, pool, tokenizer
        self.scheduler = Scheduler(artifact, weights, pool, **scheduler_options)
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[int, RequestStream] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="paged-decode-batch",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, artifact_dir: str | Path, weights_dir: str | Path, *,
             num_blocks: int | None = None, memory_budget_bytes: int | None = None,
             **scheduler_options) -> "BatchEngine":
        """Default pool: room for the largest batch bucket's worth of full-length sequences."""
        artifact = load_artifact(artifact_dir)
        weights = load_weights(weights_dir, artifact)
        if num_blocks is None and memory_budget_bytes is None:
            num_blocks = artifact.max_blocks_cap * max(artifact.manifest.batch_buckets,
                                                       default=1)
        pool = PagedKVCache.for_artifact(artifact, num_blocks=num_blocks,
                                         memory_budget_bytes=memory_budget_bytes)
        if not (Path(weights_dir) / "tokenizer.json").is_file():
            raise InputError(f"weight pack {weights_dir} has no tokenizer; the batching engine "
                             "takes text: build from a model directory with tokenizer.json")
        return cls(artifact, weights, pool, Tokenizer.from_dir(weights_dir), **scheduler_options)

    def submit(self, prompt: str | Sequence[int], *, max_new_tokens: int = 64,
               sampling: SamplingParams | None = None, stop: Sequence[str] = (),
               chat: bool = False) -> RequestStream:
        """Queue one request (text, or token ids) and return its stream at once.  Bad values
        raise here, before anything is queued."""
        return self.submit_n(prompt, 1, max_new_tokens=max_new_tokens, sampling=sampling,
                             stop=stop, chat=chat)[0]

    def submit_n(self, prompt: str | Sequence[int], n: int, *, max_new_tokens: int = 64,
                 sampling: SamplingParams | None = None, stop: Sequence[str] = (),
                 chat: bool = False) -> list[RequestStream]:
        """``n`` continuations of one prompt, prefilled once and sharing its KV blocks
        (``Scheduler.make_forks``: continuation ``i`` samples with ``seed + i``)."""
        if self._closed:
            raise InputError("the engine is closed; load a new one")
        if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
            raise InputError(f"stop={stop!r}: must be a list of non-empty strings")
        group = self.scheduler.make_forks(self._encode(prompt, chat), n, max_new_tokens,
                                          sampling, self.tokenizer.eos_ids)
        streams = [RequestStream(self, req, tuple(stop)) for req in group]
        self._inbox.put(("add", streams))
        return streams

    def generate_many(self, prompts: Sequence[str | Sequence[int]], **options) -> list[str]:
        """Submit every prompt (the same options for each) and return their completions."""
        streams = [self.submit(p, **options) for p in prompts]
        return [s.text() for s in streams]

    def close(self) -> None:
        """Cancel what runs, stop the engine's thread and free every block."""
        if not self._closed:
            self._closed = True
            self._inbox.put(("close", None))
            self._thread.join()

    def __enter__(self) -> "BatchEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _encode(self, prompt, chat: bool) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode_prompt(prompt, chat)
        return list(prompt)

    # the engine's thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        sched = self.scheduler
        while True:
            try:
                msg = self._inbox.get(block=not sched.has_work)
            except queue.Empty:
                msg = None
            if msg is not None:
                kind, stream = msg
                if kind == "close":
                    break
                if kind == "add":
                    for one in stream:  # a group of streams
                        sched.waiting.append(one.request)
                        self._streams[one.request.id] = one
                elif kind == "cancel" and not stream.request.finished:
                    sched.cancel(stream.request)
                    self._retire(stream.request)
                continue  # drain the inbox before stepping
            try:
                produced = sched.step()
            except Exception as e:  # noqa: BLE001 - any failure ends the requests it hit, with
                self._fail_all(e)  # the error re-raised in each stream; the engine goes on
                continue
            for req, token in produced:
                stream = self._streams.get(req.id)
                if stream is not None and stream._push(token) and not req.finished:
                    sched.cancel(req)
                    req.finish_reason = "stop"
                if req.finished:
                    self._retire(req)
        for req in list(sched.running) + list(sched.waiting):
            sched.cancel(req)
            self._retire(req)

    def _retire(self, req: Request) -> None:
        stream = self._streams.pop(req.id, None)
        if stream is not None:
            stream._close(req.finish_reason)

    def _fail_all(self, error: BaseException) -> None:
        sched = self.scheduler
        for req in list(sched.running) + list(sched.waiting):
            sched.cancel(req)
            stream = self._streams.pop(req.id, None)
            if stream is not None:
                stream._close("error", error)
