"""Prefill -> plan-once decode loop, with rebuild on invalidation, stop ids and streaming."""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable, Iterator

import numpy as np

from .artifact import Artifact, WeightPack
from .errors import HandleError
from .kv_pool import PagedKVCache, SessionHandle
from .sampling import Sampler, SamplingParams
from .session import PagedDecodeSession, validity_key_for


@dataclasses.dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    session_builds: int = 0
    reprefills: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class Generator:
    """Generates over one pool; holds the decode session and rebuilds it when it goes stale.

    ``pool`` and ``weights`` may be replaced between (or during) generations: the next step
    sees the changed validity key, drops the session, builds a new one and, when the sequence's
    blocks are gone with the old allocation, prefills the tokens so far again.
    Not safe to use from two threads at once.
    """

    def __init__(self, artifact: Artifact, weights: WeightPack, pool: PagedKVCache):
        self.artifact, self.weights, self.pool = artifact, weights, pool
        self.session: PagedDecodeSession | None = None
        self.stats = GenerationStats()

    def current_session(self) -> PagedDecodeSession:
        """The session for the current (artifact, weights, pool allocation), built if needed."""
        key = validity_key_for(self.artifact, self.weights, self.pool)
        if self.session is None or not self.session.is_valid_for(*dataclasses.astuple(key)):
            self.session = PagedDecodeSession(self.artifact, self.weights, self.pool)
            self.stats.session_builds += 1
        return self.session

    def _prefill(self, handle: SessionHandle, ids) -> np.ndarray:
        t0 = time.perf_counter()
        logits = self.current_session().prefill(handle, ids)
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
        session = self.current_session()
        if not self._owns(handle):
            handle = self.pool.new_sequence()
            self.stats.reprefills += 1
            return handle, self._prefill(handle, history)
        t0 = time.perf_counter()
        logits = session.realize_token(handle, token)
        self.stats.decode_seconds += time.perf_counter() - t0
        self.stats.decode_tokens += 1
        return handle, logits

    def stream(self, prompt_ids, max_new_tokens: int = 64, sampling: SamplingParams | None = None,
               stop_ids: Iterable[int] = ()) -> Iterator[int]:
        """Yield generated token ids; stops after a stop id (yielded) or max_new_tokens."""
        sampler, stop = Sampler(sampling or SamplingParams()), set(stop_ids)
        self.stats = GenerationStats(session_builds=0)
        handle = self.pool.new_sequence()
        try:
            history = [int(t) for t in np.asarray(prompt_ids).reshape(-1)]
            logits = self._prefill(handle, np.asarray(prompt_ids))
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
