"""Structured output: a token mask per step that keeps a generation inside a grammar.

The scheduler knows one small interface, :class:`TokenConstraint`: before a constrained row is
sampled it asks ``allowed()`` for the tokens the grammar admits next and masks the others;
after sampling it calls ``accept(token)``; a constraint that is ``done`` (the grammar can take
nothing more) ends its request with ``finish_reason == "stop"``.  Unconstrained rows never
touch this module.

The backend is llguidance (the constrained-decoding library of llama.cpp and vLLM): a
:class:`GrammarCompiler` indexes one tokenizer's vocabulary once, then builds a matcher per
request from a JSON schema (``{"type": "object"}`` for any JSON object).  JSON is generated
compactly (``", "`` and ``": "`` separators, no other whitespace), so a model cannot spend its
token budget on layout.
"""

from __future__ import annotations

import json
from typing import Protocol

import numpy as np

from .errors import GrammarError
from .tokenizer import Tokenizer

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class TokenConstraint(Protocol):
    """What the scheduler asks of a constraint (one per request, used on the engine's thread)."""

    @property
    def done(self) -> bool:
        """The grammar is complete and admits no further token."""

    def allowed(self) -> np.ndarray:
        """bool ``[vocab_size]``: the tokens the grammar admits next (at least one)."""

    def accept(self, token: int) -> None:
        """Advance past a sampled token (one that ``allowed()`` admitted)."""

    def copy(self) -> "TokenConstraint":
        """An independent constraint in the same state (for forked continuations)."""


class GrammarUnavailableError(GrammarError):
    """Structured output cannot be served for this tokenizer (llguidance is missing, or it
    cannot read the tokenizer: a WordPiece decoder, say); other requests are unaffected."""


class GrammarCompiler:
    """Builds :class:`TokenConstraint` objects for one tokenizer and model vocabulary.

    Build it once per engine: indexing the vocabulary costs milliseconds to a second."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        try:
            import llguidance
        except ImportError as e:
            raise GrammarUnavailableError("structured output needs llguidance: pip install "
                                          "'paged-decode[serve]' (or pip install llguidance)"
                                          ) from e
        self._llg = llguidance
        self.vocab_size = int(vocab_size)
        eos = tokenizer.eos_ids[0] if tokenizer.eos_ids else None
        try:
            self._tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(),
                                                     n_vocab=self.vocab_size, eos_token=eos)
        except (ValueError, TypeError, RuntimeError) as e:  # llguidance's word for "cannot"
            raise GrammarUnavailableError(f"structured output is not available for this "
                                          f"model's tokenizer: llguidance cannot index it "
                                          f"({e})") from e

    def json_schema(self, schema: dict | None = None) -> "LLGuidanceConstraint":
        """Output that parses as JSON and validates against ``schema`` (None: any object)."""
        if schema is None:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            grammar = self._llg.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), overrides=_JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"the JSON schema is not usable ({e})") from e
        return self._matcher(grammar, "the JSON schema")

    def regex(self, pattern: str) -> "LLGuidanceConstraint":
        """Output that matches the regular expression ``pattern`` (Rust ``regex`` syntax)."""
        if not isinstance(pattern, str):
            raise GrammarError(f"a regex must be a string, got {type(pattern).__name__}")
        try:
            grammar = self._llg.LLMatcher.grammar_from_regex(pattern)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"the regex is not usable ({e})") from e
        return self._matcher(grammar, "the regex")

    def choice(self, options: list[str]) -> "LLGuidanceConstraint":
        """Output that is exactly one of ``options`` (non-empty strings)."""
        if not (isinstance(options, list) and options
                and all(isinstance(o, str) and o for o in options)):
            raise GrammarError(f"choices must be a non-empty list of non-empty strings, got "
                               f"{options!r}")
        # Lark string literals take JSON's escapes, so json.dumps quotes any text safely
        lark = "start: " + " | ".join(json.dumps(o) for o in dict.fromkeys(options))
        try:
            grammar = self._llg.LLMatcher.grammar_from_lark(lark)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"the choices are not usable ({e})") from e
        return self._matcher(grammar, "the choices")

    def _matcher(self, grammar: str, what: str) -> "LLGuidanceConstraint":
        error = self._llg.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GrammarError(f"{what} cannot be compiled into a grammar: {error}")
        matcher = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{what} cannot be compiled into a grammar: "
                               f"{matcher.get_error()}")
        return LLGuidanceConstraint(matcher, self.vocab_size)


class LLGuidanceConstraint:
    """A :class:`TokenConstraint` over one llguidance matcher."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher, self._vocab_size = matcher, vocab_size

    @property
    def done(self) -> bool:
        return self._matcher.is_stopped()

    def allowed(self) -> np.ndarray:
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:self._vocab_size].view(bool)

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} was sampled outside the grammar "
                               f"({self._matcher.get_error()})")

    def copy(self) -> "LLGuidanceConstraint":
        return LLGuidanceConstraint(self._matcher.deep_copy(), self._vocab_size)
