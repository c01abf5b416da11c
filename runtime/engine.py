"""Text in, text out: an artifact, its weight pack, a pool and the tokenizer together.

A generation is a request of the scheduler (:mod:`.scheduler`) stepped on the caller's
thread: the same steps, stop rules and speculative decoding as the batching engine and the
server.  The :class:`~paged_decode.runtime.generate.Generator` over the same pool
(``engine.generator``) is the plan-once single-sequence loop of earlier releases.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable, Iterator

from .artifact import Artifact, WeightPack, load_artifact, load_weights
from .checks import is_int
from .errors import CapacityError, InputError
from .generate import GenerationStats, Generator, OneAtATime
from .kv_pool import PagedKVCache
from .sampling import SamplingParams
from .scheduler import Scheduler
from .speculative import SpeculativeConfig
from .tokenizer import Tokenizer


class Engine:
    """Loads once, generates many times.  Generations from several threads run one at a time.

    ``speculative``: draft and verify tokens (:mod:`.speculative`; the artifact needs batch
    buckets); ``prefix_cache``: keep a finished generation's blocks for the next one that
    begins with the same tokens (a conversation's history), in the pool's free room."""

    def __init__(self, artifact: Artifact, weights: WeightPack, pool: PagedKVCache,
                 tokenizer: Tokenizer | None = None, *,
                 speculative: SpeculativeConfig | None = None, prefix_cache: bool = False):
        self.artifact, self.weights, self.pool, self.tokenizer = artifact, weights, pool, tokenizer
        self.generator = Generator(artifact, weights, pool)
        self.scheduler = Scheduler(artifact, weights, pool, max_running=1,
                                   prefix_cache=prefix_cache, speculative=speculative)
        self.stats = GenerationStats()
        self._exclusive = OneAtATime("engine")

    @classmethod
    def load(cls, artifact_dir: str | Path, weights_dir: str | Path, *,
             num_blocks: int | None = None, memory_budget_bytes: int | None = None) -> "Engine":
        """Default pool: room for one sequence of the artifact's full context."""
        artifact = load_artifact(artifact_dir)
        weights = load_weights(weights_dir, artifact)
        pool = PagedKVCache.for_artifact(artifact, num_blocks=num_blocks,
                                         memory_budget_bytes=memory_budget_bytes)
        tok_dir = Path(weights_dir)
        tokenizer = Tokenizer.from_dir(tok_dir) if (tok_dir / "tokenizer.json").is_file() else None
        return cls(artifact, weights, pool, tokenizer)

    def _require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise InputError(f"weight pack {self.weights.path} has no tokenizer; pass token ids "
                             "instead of text, or build from a model directory with tokenizer.json")
        return self.tokenizer

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        return self._require_tokenizer().encode_prompt(prompt, chat, "--prompt")

    def stream_text(self, prompt: str, *, chat: bool = False, max_new_tokens: int = 64,
                    sampling: SamplingParams | None = None) -> Iterator[str]:
        """Yield decoded text pieces as tokens arrive; stops at the model's end-of-sequence ids.
        The prompt is encoded here, before the first piece is asked for."""
        return self.stream_ids_text(self.encode_prompt(prompt, chat),
                                    max_new_tokens=max_new_tokens, sampling=sampling)

    def stream_ids_text(self, ids: list[int], *, max_new_tokens: int = 64,
                        sampling: SamplingParams | None = None) -> Iterator[str]:
        """``stream_text`` for a prompt already encoded (``encode_prompt``)."""
        tok = self._require_tokenizer()
        decoder = tok.stream(skip_special_tokens=True)
        eos = () if isinstance(sampling, SamplingParams) and sampling.ignore_eos else tok.eos_ids
        for token in self.stream_ids(ids, max_new_tokens, sampling, eos):
            piece = decoder.push(token)
            if piece:
                yield piece
        tail = decoder.flush()
        if tail:
            yield tail

    def stream_ids(self, ids, max_new_tokens: int = 64, sampling: SamplingParams | None = None,
                   stop_ids: Iterable[int] = ()) -> Iterator[int]:
        """Yield generated token ids; stops after a stop id (yielded) or ``max_new_tokens``.
        Checked here, before the first ``next()`` (:class:`InputError` and its kind)."""
        if not is_int(max_new_tokens) or max_new_tokens < 0:
            raise InputError(f"max_new_tokens={max_new_tokens!r}: must be an int >= 0; pass the "
                             "number of tokens to generate")
        # a generation past the artifact's context runs up to it, then fails there (unless a
        # stop id ends it first), as a sequence outgrowing its blocks does
        room = self.artifact.max_tokens + 1 - len(ids) if hasattr(ids, "__len__") else 1
        req = self.scheduler.make_request(ids, max(min(max_new_tokens, room), 1), sampling,
                                          stop_ids)
        if max_new_tokens == 0:
            return iter(())
        return self._stream(req, max_new_tokens)

    def _stream(self, req, wanted: int) -> Iterator[int]:
        with self._exclusive.hold():
            try:
                yield from self._steps(req)
                if req.finish_reason == "length" and len(req.tokens) < wanted:
                    cap, n = self.artifact.max_tokens, len(req.prompt) + len(req.tokens)
                    raise CapacityError(
                        f"the prompt ({len(req.prompt)} tokens) and {len(req.tokens)} new ones "
                        f"fill the artifact's context: {n} tokens exceed max_tokens={cap}, "
                        "the artifact's max_blocks_cap * block_size; shorten the prompt or "
                        "compile with a larger max_blocks_cap (paged-compile --max-context)")
            finally:
                self.scheduler.cancel(req)  # frees its blocks if it did not finish

    def _steps(self, req) -> Iterator[int]:
        sched, t0 = self.scheduler, time.perf_counter()
        drafted, accepted = sched.drafted_tokens, sched.accepted_tokens
        self.stats = stats = GenerationStats(prompt_tokens=len(req.prompt))
        sched.waiting.append(req)
        while not req.finished:
            produced = [t for r, t in sched.step() if r is req]
            if req.error is not None:
                raise req.error
            times = req.token_times
            if times:  # the first token is the prompt's; the others are decoded
                stats.prefill_seconds = times[0] - t0
                stats.decode_tokens, stats.decode_seconds = len(times) - 1, times[-1] - times[0]
            stats.drafted_tokens = sched.drafted_tokens - drafted
            stats.accepted_tokens = sched.accepted_tokens - accepted
            yield from produced
