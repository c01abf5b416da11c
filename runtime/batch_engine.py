"""Text in, text out for many requests at once: the scheduler on a thread of its own.

``BatchEngine.submit`` queues a request and returns a :class:`RequestStream` at once; the
engine's thread admits it at its next step, and the stream yields text pieces as tokens arrive
(``cancel()`` ends it at the next step and frees its blocks).  ``generate_many`` submits a list
and waits for all.  Stop strings end a request in the scheduler, at the token that completes
one (:class:`~.request.StopStrings`): the text up to the first stop string is returned, the
stop string is not, and text that could still begin a stop string is held back until it
cannot.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import threading
from pathlib import Path
from typing import Callable, Iterator, Sequence

from .artifact import Artifact, WeightPack, load_artifact, load_weights
from .checks import check_stop_ids, is_int
from .errors import EngineStoppedError, InputError, QueueFullError
from .kv_pool import PagedKVCache
from .request import StopStrings
from .sampling import SamplingParams
from .scheduler import Request, Scheduler, TokenLogprob
from .tokenizer import Tokenizer

_END = object()
_POLL_S = 0.1  # how often a wait checks that the engine's thread still runs
_CONSTRAINT_METHODS = ("allowed", "accept", "copy")  # TokenConstraint's (and ``done``)


@dataclasses.dataclass(frozen=True)
class Delta:
    """A piece of a request's output: text, and the log-probabilities of the tokens it came
    from (only when the request asked for them; a stop id has text and no entry)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


# listener(stream, delta): called on the engine's thread for each piece, then once with None
# when the stream ends (its finish_reason and error are set by then); it must not block.  A
# listener that raises ends its own request (finish_reason "error", the exception as its
# ``error``) and is not called again; the engine and the other requests go on.
Listener = Callable[["RequestStream", "Delta | None"], None]


class RequestStream:
    """One submitted request: iterate it for text pieces; ``text()`` waits for all of it.

    With a ``listener`` (see :data:`Listener`) the pieces go to it instead, and the stream is
    not iterated."""

    def __init__(self, engine: "BatchEngine", req: Request, listener: Listener | None = None):
        self._engine, self.request = engine, req
        self._listener = listener
        self._pieces: queue.Queue = queue.Queue()
        self._sent = 0  # how much of the request's text was handed out
        self._pushed = 0  # tokens seen, so the next one's log-probability is logprobs[_pushed]
        self._held: list[TokenLogprob] = []  # entries of tokens whose text is not out yet
        self.error: BaseException | None = None
        self.finish_reason: str | None = None
        self._listener_error: BaseException | None = None
        self._ended = threading.Event()  # set once finish_reason and error are

    # called on the engine's thread -------------------------------------------------------------
    def _push(self, token: int) -> None:
        """Hand out the text that the request's next token made final (the scheduler has
        decoded it and ended the request at a stop string: ``request.text``)."""
        req = self.request
        if token not in req.stop_ids and req.top_logprobs is not None:
            self._held.append(req.logprobs[self._pushed])
        self._pushed += 1
        self._send(req.text.ready(self._pushed))

    def _send(self, upto: int, final: bool = False) -> None:
        if upto > self._sent or (final and self._held):
            text = self.request.text.text
            self._deliver(Delta(text[self._sent:upto], tuple(self._held)))
            self._sent, self._held = upto, []

    def _deliver(self, item) -> None:
        if self._listener is None:
            self._pieces.put(item)
        elif self._listener_error is None:
            try:
                self._listener(self, None if item is _END else item)
            except BaseException as e:  # noqa: BLE001 - the user's code: it ends this request
                self._listener_error = e  # only, whatever it raised (the engine's thread lives)

    def _close(self, reason: str | None, error: BaseException | None = None) -> None:
        text = self.request.text
        if error is None and reason != "stop":
            text.flush()
        self._send(len(text.text), final=True)
        if self._listener_error is not None:  # its last pieces raised in the listener
            reason, error = "error", error or self._listener_error
        self.finish_reason, self.error = reason, error
        self._ended.set()
        self._deliver(_END)

    # called by the user ------------------------------------------------------------------------
    def deltas(self) -> Iterator[Delta]:
        """The pieces as :class:`Delta` objects (text with log-probabilities).  A stream with a
        listener has none to give (they went to the listener): :class:`InputError`."""
        if self._listener is not None:
            raise InputError("this stream has a listener: its pieces go to the listener, not "
                             "to an iterator; use text() for the whole completion, or submit "
                             "without listener=")
        while True:
            piece = self._next_piece()
            if piece is _END:
                self._pieces.put(_END)  # a second iteration ends at once
                if self.error is not None:
                    raise self.error
                return
            yield piece

    def __iter__(self) -> Iterator[str]:
        return (d.text for d in self.deltas() if d.text)

    def text(self) -> str:
        """The whole completion (waits for the request to finish; re-raises its error)."""
        if self._listener is None:
            return "".join(self)
        self.wait()
        if self.error is not None:
            raise self.error
        return self.request.text.text

    def wait(self) -> None:
        """Wait until the request has ended (``finish_reason`` set);
        :class:`EngineStoppedError` if the engine's thread stops first."""
        while not self._ended.wait(_POLL_S):
            self._check_engine()

    def _next_piece(self):
        while True:
            try:
                return self._pieces.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_engine()

    def _check_engine(self) -> None:
        """The engine's thread ends every stream before it stops; one still open when it has
        stopped would wait forever."""
        if not self._engine._thread.is_alive() and not self._ended.is_set():
            raise EngineStoppedError("the engine's thread stopped before this request ended; "
                                     "load a new engine")

    def cancel(self) -> None:
        """End the request at the engine's next step (its blocks are freed there)."""
        self._engine._inbox.put(("cancel", self))

    @property
    def tokens(self) -> list[int]:
        return list(self.request.tokens)


class BatchEngine:
    """Continuous batching over one artifact: many requests, one pool, one scheduler thread.

    Thread safety: ``submit`` / ``cancel`` / ``generate_many`` may be called from any thread;
    the model runs only on the engine's thread.  ``max_waiting`` bounds the requests submitted
    beyond those that can run at once (``scheduler.max_running``): a submission past it raises
    :class:`~paged_decode.runtime.errors.QueueFullError` instead of queueing without bound.
    """

    def __init__(self, artifact: Artifact, weights: WeightPack, pool: PagedKVCache,
                 tokenizer: Tokenizer, *, max_waiting: int | None = None, **scheduler_options):
        self.artifact, self.weights, self.pool, self.tokenizer = artifact, weights, pool, tokenizer
        self.scheduler = Scheduler(artifact, weights, pool, **scheduler_options)
        if max_waiting is not None and not (is_int(max_waiting) and max_waiting >= 0):
            raise InputError(f"max_waiting={max_waiting!r}: must be an integer >= 0, or None "
                             "for no bound")
        self.max_waiting = max_waiting
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[int, RequestStream] = {}
        self._active = 0  # submitted and not yet ended; under _lock
        self._lock = threading.Lock()
        self._grammars = None
        self._grammars_lock = threading.Lock()  # not _lock: building it must not hold up submit
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

    def submit(self, prompt: str | Sequence[int], **options) -> RequestStream:
        """Queue one request (text, or token ids) and return its stream at once; the options
        are :meth:`submit_n`'s.  Bad values raise here, before anything is queued."""
        return self.submit_n(prompt, 1, **options)[0]

    def submit_n(self, prompt: str | Sequence[int], n: int, *, max_new_tokens: int = 64,
                 sampling: SamplingParams | None = None, stop: Sequence[str] = (),
                 stop_token_ids: Sequence[int] | None = (), chat: bool = False,
                 top_logprobs: int | None = None, constraint=None,
                 listener: Listener | None = None) -> list[RequestStream]:
        """``n`` continuations of one prompt, prefilled once and sharing its KV blocks
        (``Scheduler.make_forks``: continuation ``i`` samples with ``seed + i``).

        ``stop``: strings that end the text (not included); ``stop_token_ids``: ids that end it
        besides the tokenizer's end-of-sequence ids (their text is not included);
        ``top_logprobs``: record each token's log-probability and that many alternatives
        (:class:`Delta`); ``constraint``: a grammar (``self.grammars.json_schema(...)``);
        ``listener``: receives the pieces instead of the streams' iterators."""
        if not self.alive:
            raise EngineStoppedError(("the engine is closed" if self._closed else
                                      "the engine's thread has stopped") + "; load a new one")
        if not (is_int(max_new_tokens) and max_new_tokens >= 1):
            raise InputError(f"max_new_tokens={max_new_tokens!r}: must be an integer >= 1")
        if (isinstance(stop, str) or not isinstance(stop, (list, tuple))
                or not all(isinstance(s, str) and s for s in stop)):
            raise InputError(f"stop={stop!r}: must be a list of non-empty strings")
        _check_options(sampling, chat, constraint, listener)
        ignore_eos = isinstance(sampling, SamplingParams) and sampling.ignore_eos
        stop_ids = set(() if ignore_eos else self.tokenizer.eos_ids) | check_stop_ids(
            () if stop_token_ids is None else stop_token_ids, "stop_token_ids")
        group = self.scheduler.make_forks(self._encode(prompt, chat), n, max_new_tokens,
                                          sampling, stop_ids,
                                          top_logprobs=top_logprobs, constraint=constraint)
        if self.capacity is not None and len(group) > self.capacity:
            raise InputError(f"n={n}: more continuations than this engine holds at once "
                             f"({self.capacity}: max_running {self.scheduler.max_running} + "
                             f"max_waiting {self.max_waiting}); ask for at most "
                             f"{self.capacity}, or raise max_waiting")
        for req in group:
            req.text = StopStrings(self.tokenizer.stream(skip_special_tokens=True), tuple(stop),
                                   req.stop_ids)
        streams = [RequestStream(self, req, listener) for req in group]
        with self._lock:
            bound = self.capacity
            if bound is not None and self._active + len(streams) > bound:
                raise QueueFullError(f"{self._active} requests are running or waiting, the "
                                     f"engine takes {bound} (max_running "
                                     f"{self.scheduler.max_running} + max_waiting "
                                     f"{self.max_waiting}); retry when some have finished")
            self._active += len(streams)
        self._inbox.put(("add", streams))
        return streams

    @property
    def grammars(self):
        """The :class:`~paged_decode.runtime.grammar.GrammarCompiler` of this model's tokenizer
        (built at first use); :class:`~paged_decode.runtime.grammar.GrammarUnavailableError`
        where this tokenizer cannot have one (decided once, not retried per request)."""
        from .grammar import GrammarCompiler, GrammarUnavailableError

        with self._grammars_lock:
            if self._grammars is None:
                try:
                    self._grammars = GrammarCompiler(self.tokenizer,
                                                     self.artifact.manifest.vocab_size)
                except GrammarUnavailableError as e:
                    self._grammars = e
            if isinstance(self._grammars, GrammarUnavailableError):
                raise GrammarUnavailableError(str(self._grammars))
            return self._grammars

    @property
    def capacity(self) -> int | None:
        """The most requests (continuations) running and waiting at once: ``max_running +
        max_waiting``, or None for no bound."""
        if self.max_waiting is None:
            return None
        return self.scheduler.max_running + self.max_waiting

    @property
    def alive(self) -> bool:
        """The engine takes and runs requests (not closed, its thread running)."""
        return not self._closed and self._thread.is_alive()

    def stats(self) -> dict:
        """Counters for monitoring, readable from any thread (values may be one step old)."""
        sched, cache = self.scheduler, self.scheduler.cache
        with self._lock:
            active = self._active
        running = len(sched.running)
        return {"running": running, "waiting": max(active - running, 0),
                "blocks_total": self.pool.num_blocks,
                "blocks_used": self.pool.num_blocks - self.pool.num_free,
                "steps": sched.steps, "preemptions": sched.preemptions,
                "drafted_tokens": sched.drafted_tokens,
                "accepted_tokens": sched.accepted_tokens,
                "prefix_cache": cache.stats() if cache is not None else None}

    def generate_many(self, prompts: Sequence[str | Sequence[int]], **options) -> list[str]:
        """Submit every prompt (the same options for each) and return their completions.  More
        prompts than the engine holds at once (``capacity``) go in as earlier ones finish.  A
        prompt refused at submission cancels those still running before the error is raised,
        so nothing keeps running for a result no one receives."""
        texts: list[str | None] = [None] * len(prompts)
        running: collections.deque = collections.deque()  # (index, stream), oldest first
        try:
            for i, p in enumerate(prompts):
                while True:
                    try:
                        running.append((i, self.submit(p, **options)))
                        break
                    except QueueFullError:
                        if not running:  # full of others' requests: nothing of ours to wait for
                            raise
                        j, oldest = running.popleft()
                        texts[j] = oldest.text()
            while running:
                j, oldest = running.popleft()
                texts[j] = oldest.text()
            return texts
        except BaseException:
            for _, s in running:
                s.cancel()
            raise

    def cancel_all(self) -> None:
        """End every running and waiting request at the engine's next step (finish_reason
        "cancelled"); the engine goes on taking requests (a server draining for shutdown)."""
        self._inbox.put(("cancel_all", None))

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
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise InputError(f"prompt={bytes(prompt[:20])!r} is bytes, not text or token ids; "
                             "decode it (prompt.decode('utf-8')) or pass a list of token ids")
        if not isinstance(prompt, Sequence) and not hasattr(prompt, "__array__"):
            raise InputError(f"prompt must be text or a list of token ids, got "
                             f"{type(prompt).__name__}")
        return list(prompt)  # each id checked by the scheduler (make_request)

    # the engine's thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._run()
        finally:  # whatever stopped the loop, no stream is left waiting
            self._end_unended()

    def _end_unended(self) -> None:
        for stream in list(self._streams.values()):
            if not stream._ended.is_set():
                stream.finish_reason = "error"
                stream.error = EngineStoppedError("the engine's thread stopped; load a new "
                                                  "engine")
                stream._ended.set()
                if stream._listener is None:
                    stream._pieces.put(_END)

    def _run(self) -> None:
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
                elif kind == "cancel_all":
                    self._end_all()
                continue  # drain the inbox before stepping
            try:
                produced = sched.step()
            except Exception as e:  # noqa: BLE001 - any failure ends the requests it hit, with
                self._end_all(e)  # the error re-raised in each stream; the engine goes on
                continue
            # a request can produce two tokens in one step (its prompt's last chunk, then a
            # decode row): each is pushed before any stream closes
            for req, token in produced:
                stream = self._streams.get(req.id)
                if stream is None:
                    continue
                stream._push(token)
                if stream._listener_error is not None:
                    if not req.finished:
                        sched.cancel(req)
                    self._retire(req, stream._listener_error)
            for req in dict.fromkeys(req for req, _ in produced if req.finished):
                self._retire(req)
            for req in sched.failed:
                self._retire(req, req.error)
        self._end_all()
        self._drain_after_close()

    def _drain_after_close(self) -> None:
        """Streams submitted while the engine closed end as cancelled, never waiting forever."""
        while True:
            try:
                kind, streams = self._inbox.get_nowait()
            except queue.Empty:
                return
            for stream in streams if kind == "add" else ():
                stream.request.finish_reason = "cancelled"
                self._streams[stream.request.id] = stream
                self._retire(stream.request)

    def _retire(self, req: Request, error: BaseException | None = None) -> None:
        stream = self._streams.pop(req.id, None)
        if stream is not None:
            # the stream ends before the count drops: whoever reads stats() showing nothing
            # active finds every stream's finish_reason set
            try:
                stream._close("error" if error is not None else req.finish_reason, error)
            finally:
                with self._lock:
                    self._active -= 1

    def _end_all(self, error: BaseException | None = None) -> None:
        """Cancel every running and waiting request; its stream ends with ``error``, or as
        cancelled without one."""
        sched = self.scheduler
        for req in list(sched.running) + list(sched.waiting):
            sched.cancel(req)
            self._retire(req, error)


def _check_options(sampling, chat, constraint, listener) -> None:
    """:class:`InputError` naming the first of ``submit_n``'s object arguments that is not what
    it takes (each would otherwise fail later, on the engine's thread)."""
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise InputError(f"sampling={sampling!r}: must be a SamplingParams, or None for greedy")
    if not isinstance(chat, bool):
        raise InputError(f"chat={chat!r}: must be True or False")
    if constraint is not None and not (
            all(callable(getattr(constraint, m, None)) for m in _CONSTRAINT_METHODS)
            and hasattr(constraint, "done")):
        raise InputError(f"constraint={constraint!r}: must be a TokenConstraint (allowed, "
                         "accept, copy, done), such as engine.grammars.json_schema(...); or "
                         "None")
    if listener is not None and not callable(listener):
        raise InputError(f"listener={listener!r}: must be a callable (stream, delta) -> None, "
                         "or None")
