"""Text in, text out: an artifact, its weight pack, a pool and the tokenizer together."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from .artifact import Artifact, WeightPack, load_artifact, load_weights
from .errors import InputError
from .generate import Generator
from .kv_pool import PagedKVCache
from .sampling import SamplingParams
from .tokenizer import Tokenizer


class Engine:
    """Loads once, generates many times.  Generations from several threads run one at a time
    (see :class:`~paged_decode.runtime.generate.Generator`)."""

    def __init__(self, artifact: Artifact, weights: WeightPack, pool: PagedKVCache,
                 tokenizer: Tokenizer | None = None):
        self.artifact, self.weights, self.pool, self.tokenizer = artifact, weights, pool, tokenizer
        self.generator = Generator(artifact, weights, pool)

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
        for token in self.generator.stream(ids, max_new_tokens, sampling, eos):
            piece = decoder.push(token)
            if piece:
                yield piece
        tail = decoder.flush()
        if tail:
            yield tail
