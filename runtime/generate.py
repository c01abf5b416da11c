"""Prefill -> plan-once decode loop over the step runner, with rebuild on invalidation, stop ids
and streaming."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterable, Iterator

import numpy as np

from .artifact import Artifact, WeightPack
from .checks import check_stop_ids, is_int
from .errors import BusyError, HandleError, InputError
from .kv_pool import PagedKVCache, SessionHandle
from .runner import Row, StepRunner
from .sampling import Sampler, SamplingParams
from .session import PagedDecodeSession, check_prompt, validity_key_for


@dataclasses.dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    session_builds: int = 0
    reprefills: int = 0
    drafted_tokens: int = 0  # speculative decoding: tokens drafted, and accepted by the model
    accepted_tokens: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class OneAtATime:
    """Generations on one object run one at a time; the thread holding it asking again is a
    :class:`BusyError` (it would wait for itself forever)."""

    def __init__(self, what: str):
        self._what = what
        self._lock = threading.Lock()
        self._holder: int | None = None  # thread id of the generation running now

    @contextlib.contextmanager
    def hold(self):
        me = threading.get_ident()
        if self._holder == me:
            raise BusyError(f"this thread already has an unfinished generation on this "
                            f"{self._what} (a stream not read to its end); finish it or call its "
                            "close() before starting another")
        with self._lock:
            self._holder = me
            try:
                yield
            finally:
                self._holder = None


class Generator:
    """Generates one sequence at a time over a pool it shares with its caller; holds a step
    runner (:mod:`.runner`, the calls the scheduler makes) and rebuilds it when it goes stale.

    ``pool`` and ``weights`` may be replaced between (or during) generations: the next step
    sees the changed validity key, drops the runner, builds a new one and, when the sequence's
    blocks are gone with the old allocation, prefills the tokens so far again.
    Thread safety: generations on one generator run one at a time (a second thread's waits
    for the first to finish; its runner, buffers and stats are one generation's state);
    generators over separate pools run concurrently.
    """

    def __init__(self, artifact: Artifact, weights: WeightPack, pool: PagedKVCache):
        self.artifact, self.weights, self.pool = artifact, weights, pool
        self.runner: StepRunner | None = None
        self.stats = GenerationStats()
        self._exclusive = OneAtATime("generator")

    @property
    def session(self) -> PagedDecodeSession | None:
        """The B = 1 plan of the current runner (None before the first generation)."""
        return None if self.runner is None else self.runner.single

    def current_runner(self) -> StepRunner:
        """The runner for the current (artifact, weights, pool allocation), built if needed."""
        key = validity_key_for(self.artifact, self.weights, self.pool)
        if self.runner is None or not self.runner.is_valid_for(*dataclasses.astuple(key)):
            self.runner = StepRunner(self.artifact, self.weights, self.pool)
            self.stats.session_builds += 1
        return self.runner

    def current_session(self) -> PagedDecodeSession:
        """The B = 1 plan for the current (artifact, weights, pool allocation)."""
        return self.current_runner().single

    def _prefill(self, handle: SessionHandle, ids) -> np.ndarray:
        t0 = time.perf_counter()
        logits = self.current_runner().prefill(handle, ids)
        self.stats.prefill_seconds += time.perf_counter() - t0
        self.stats.prompt_tokens += len(ids)
        return logits

    def _owns(self, handle: SessionHandle) -> bool:
        try:
            self.pool.check_handle(handle)
        except HandleError:
            return False
        return True

    def _step(self, handle: SessionHandle, history: list[int], token: int):
        """One decode step; re-prefills ``history`` into a new sequence if the old one died."""
        runner = self.current_runner()
        if not self._owns(handle):
            if handle.is_live:  # the pool was swapped, not cleared: free it in its old pool
                handle.release()
            handle = self.pool.new_sequence()
            self.stats.reprefills += 1
            return handle, self._prefill(handle, history)
        t0 = time.perf_counter()
        logits = runner.run([Row(handle, [token])])[0][0]
        self.stats.decode_seconds += time.perf_counter() - t0
        self.stats.decode_tokens += 1
        return handle, logits

    def stream(self, prompt_ids, max_new_tokens: int = 64, sampling: SamplingParams | None = None,
               stop_ids: Iterable[int] = ()) -> Iterator[int]:
        """Yield generated token ids; stops after a stop id (yielded) or max_new_tokens.

        The arguments are checked here, before the first ``next()``: a bad prompt, a negative or
        non-int ``max_new_tokens``, bad stop ids or sampling params raise an :class:`InputError`
        subclass at once and allocate nothing.  A generation that outgrows the artifact's
        ``max_blocks_cap * block_size`` raises :class:`CapacityError` from the iterator.
        """
        vocab = self.artifact.manifest.vocab_size
        ids = check_prompt(prompt_ids, vocab)
        if not is_int(max_new_tokens) or max_new_tokens < 0:
            raise InputError(f"max_new_tokens={max_new_tokens!r}: must be an int >= 0; pass the "
                             "number of tokens to generate")
        stop = check_stop_ids(stop_ids)
        sampler = Sampler(sampling, prompt=ids, stop_ids=stop)
        sampler.params.check_vocab(vocab)
        return self._stream(ids, int(max_new_tokens), sampler, stop)

    def _stream(self, ids: np.ndarray, max_new_tokens: int, sampler: Sampler,
                stop: set[int]) -> Iterator[int]:
        with self._exclusive.hold():
            self.stats = GenerationStats(session_builds=0)
            handle = self.pool.new_sequence()
            try:
                history = [int(t) for t in ids]
                logits = self._prefill(handle, ids)
                for i in range(max_new_tokens):
                    token = sampler.sample(logits)
                    yield token
                    history.append(token)
                    if token in stop or i + 1 == max_new_tokens:
                        break
                    handle, logits = self._step(handle, history, token)
            finally:
                if self._owns(handle):
                    handle.release()

    def generate(self, prompt_ids, max_new_tokens: int = 64,
                 sampling: SamplingParams | None = None, stop_ids: Iterable[int] = ()) -> list[int]:
        return list(self.stream(prompt_ids, max_new_tokens, sampling, stop_ids))
