"""The sampling controls that change a request's logits before it is sampled, and their state.

Each control follows its usual definition, in vLLM's order:

1. ``logit_bias``: a fixed value added to a token's logit (OpenAI's); a bias of -100 bans the
   token outright (its logit becomes ``-inf``), as OpenAI documents -100 to act.
2. ``min_tokens``: until that many tokens are out, the request's stop ids (end-of-sequence and
   ``stop_token_ids``) are banned, so it cannot end early.
3. ``repetition_penalty`` (vLLM's and HF's, multiplicative): every token of the prompt or the
   output so far has a positive logit divided by the penalty and a negative one multiplied.
4. ``frequency_penalty`` / ``presence_penalty`` (OpenAI's): a token's logit loses
   ``frequency * count + presence * (count > 0)``, counting the output tokens only.

A request that uses none of them has no :class:`LogitsProcessor` at all: its rows take the
sampler's plain path (greedy rows one ``argmax`` over the batch) and pay nothing for this module.
"""

from __future__ import annotations

import numpy as np

BAN = -100.0  # the logit_bias that bans a token (OpenAI's range is [-100, 100])


def uses_processor(params) -> bool:
    """Whether ``params`` (a ``SamplingParams``) changes the logits before sampling."""
    return bool(params.logit_bias or params.min_tokens or params.repetition_penalty != 1
                or params.frequency_penalty or params.presence_penalty)


class LogitsProcessor:
    """One request's logit controls: its prompt, the tokens it produced, its stop ids.

    Owned by that request's sampler (one thread at a time); :meth:`record` is called with each
    token the request takes, after :meth:`apply` produced the logits it was drawn from."""

    def __init__(self, params, prompt=(), stop_ids=()):
        self.params = params
        bias = dict(params.logit_bias or ())
        self._bias_ids = np.fromiter(bias, np.int64, len(bias))
        self._bias = np.array([-np.inf if v <= BAN else v for v in bias.values()], np.float32)
        self._hold = np.array(sorted(int(t) for t in stop_ids), np.int64)
        self._repeat = params.repetition_penalty != 1
        self._seen = set(int(t) for t in prompt) if self._repeat else set()
        self._seen_ids = np.fromiter(self._seen, np.int64, len(self._seen))
        self._counts: dict[int, int] = {}
        self.produced = 0

    def record(self, token: int) -> None:
        """The request took ``token``."""
        token = int(token)
        self.produced += 1
        if self.params.frequency_penalty or self.params.presence_penalty:
            self._counts[token] = self._counts.get(token, 0) + 1
        if self._repeat and token not in self._seen:
            self._seen.add(token)
            self._seen_ids = np.append(self._seen_ids, token)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A float32 copy of ``logits`` (1-D ``[vocab_size]``) with the controls applied."""
        p = self.params
        x = np.array(logits, dtype=np.float32)
        if len(self._bias_ids):
            x[self._bias_ids] += self._bias
        if self.produced < p.min_tokens and len(self._hold):
            x[self._hold[self._hold < len(x)]] = -np.inf
        if self._repeat and len(self._seen_ids):
            v = x[self._seen_ids]
            r = np.float32(p.repetition_penalty)
            x[self._seen_ids] = np.where(v > 0, v / r, v * r)
        if self._counts:
            ids = np.fromiter(self._counts, np.int64, len(self._counts))
            counts = np.fromiter(self._counts.values(), np.float32, len(self._counts))
            x[ids] -= np.float32(p.frequency_penalty) * counts + np.float32(p.presence_penalty)
        return x
