"""A draft model for speculative decoding: a smaller (or lower-precision) artifact with the
target's tokenizer, decoded greedily to propose the target's next tokens.

It has its own pool, one sequence per request, kept in step with the target's: before
drafting, the draft sequence is cut back to what it shares with the request's tokens
(``truncate_to``: what verification rejected goes) and the rest is run in one step (a small
batch plan where the draft artifact has buckets: prefill's matrix kernels cost several decode
steps on two tokens); then it decodes the drafted tokens one at a time.  How many to draft weighs their verification and
their own decode steps against the acceptance seen so far (:func:`.speculative.best_length`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .artifact import Artifact, WeightPack, load_artifact, load_weights
from .errors import InputError, OutOfBlocksError
from .kv_pool import PagedKVCache
from .runner import Row, StepRunner
from .speculative import best_length

_DECAY = 0.9
_PRIOR_STEP = 0.3  # a draft decode step over the target's, until both were measured


class DraftModel:
    """The loaded draft artifact and its weights; its pool and runner are made for the
    scheduler that drafts with it (:meth:`drafter`)."""

    def __init__(self, artifact: Artifact, weights: WeightPack):
        self.artifact, self.weights = artifact, weights
        self.runner: StepRunner | None = None

    @classmethod
    def load(cls, artifact_dir: str | Path, weights_dir: str | Path) -> "DraftModel":
        artifact = load_artifact(artifact_dir)
        return cls(artifact, load_weights(weights_dir, artifact))

    def check_pairs_with(self, target: Artifact) -> None:
        """The draft's tokens must be the target's: the same vocabulary."""
        mine, theirs = self.artifact.manifest, target.manifest
        if mine.vocab_size != theirs.vocab_size:
            raise InputError(f"draft model {mine.name} has a vocabulary of {mine.vocab_size} "
                             f"tokens, the target {theirs.name} {theirs.vocab_size}: a draft "
                             "model must share the target's tokenizer")

    def drafter(self, max_running: int) -> "DraftModelDrafter":
        """One request's drafter (the pool is made at the first, for ``max_running``
        sequences of the draft artifact's whole context)."""
        if self.runner is None:
            pool = PagedKVCache.for_artifact(
                self.artifact, num_blocks=self.artifact.max_blocks_cap * max(max_running, 1))
            self.runner = StepRunner(self.artifact, self.weights, pool)
        return DraftModelDrafter(self)


class DraftModelDrafter:
    """One request's draft sequence and acceptance estimate."""

    def __init__(self, model: DraftModel):
        self.model, self.runner = model, model.runner
        self.handle = self.runner.pool.new_sequence()
        self.known: list[int] = []  # the tokens whose K/V the draft sequence holds
        # a model made to draft is expected to agree: it drafts until it is seen not to
        self._stats = [3.0, 1.0]

    def plan(self, tokens: Sequence[int], room: int, verify_cost, decode_s=None) -> list[int]:
        step = self.runner.seconds.get(1)
        ratio = step / decode_s if step and decode_s else _PRIOR_STEP
        k = room if verify_cost is None else best_length(
            self.acceptance(), room, lambda rows: verify_cost(rows) + (rows - 1) * ratio)
        if not k or len(tokens) + k > self.model.artifact.max_tokens:
            return []
        try:
            return self._generate(list(tokens), k)
        except OutOfBlocksError:  # the draft pool is full: this step goes without
            return []

    def _generate(self, tokens: list[int], k: int) -> list[int]:
        shared = 0
        for a, b in zip(self.known, tokens[:-1]):
            if a != b:
                break
            shared += 1
        self.handle.truncate_to(shared)
        logits = self.runner.run([Row(self.handle, tokens[shared:])])[0][-1]
        out = [int(logits.argmax())]
        while len(out) < k:
            out.append(int(self.runner.run([Row(self.handle, [out[-1]])])[0][-1].argmax()))
        self.known = tokens + out[:-1]
        return out

    def acceptance(self) -> float:
        accepted, rejected = self._stats
        return accepted / (accepted + rejected)

    def record(self, drafted: int, accepted: int) -> None:
        self._stats[0] = _DECAY * self._stats[0] + accepted
        self._stats[1] = _DECAY * self._stats[1] + (accepted < drafted)

    def close(self) -> None:
        if self.handle.is_live:
            self.handle.release()
