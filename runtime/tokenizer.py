"""The deploy-side tokenizer: ``tokenizer.json`` + ``tokenizer_meta.json`` from an artifact folder.

Needs only ``tokenizers`` and ``jinja2`` (never ``paged_decode.compile``; ``jinja2`` is imported
at the first chat template, which a plain prompt never needs).  The two files are written at
build time by ``compile.tokenizer_export.export_tokenizer``:

- ``tokenizer.json``: a ``tokenizers.Tokenizer`` (its post-processor is not used; BOS is added here)
- ``tokenizer_meta.json``: ``{"bos_id": int|null, "eos_ids": [int], "add_bos": bool,
  "chat_template": str|null}``
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Iterable

from typing import TYPE_CHECKING

import numpy as np
import tokenizers

from paged_decode.runtime.errors import ArtifactError, InputError
from paged_decode.runtime.host_memory import release_free_heap

if TYPE_CHECKING:
    import jinja2

TOKENIZER_FILE = "tokenizer.json"
META_FILE = "tokenizer_meta.json"


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template and stop ids."""

    def __init__(self, backend: tokenizers.Tokenizer, bos_id: int | None, eos_ids: list[int],
                 add_bos: bool, chat_template: str | None):
        self.backend = backend
        self.bos_id = bos_id
        self.eos_ids = list(eos_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        self._bytes_of = None  # token id -> bytes, built at first use (token_bytes)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load ``tokenizer.json`` and ``tokenizer_meta.json`` from ``path``."""
        path = Path(path)
        for name in (TOKENIZER_FILE, META_FILE):
            if not (path / name).is_file():
                raise ArtifactError(f"{path}: {name} is missing; rebuild the artifact "
                                    "(paged-compile writes the tokenizer next to the library)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path / TOKENIZER_FILE))
            meta = json.loads((path / META_FILE).read_text())
        except Exception as e:  # tokenizers raises a bare Exception on a damaged file
            raise ArtifactError(f"{path}: tokenizer files are damaged ({e}); "
                                "rebuild the artifact") from e
        release_free_heap()  # what parsing the vocabulary's JSON freed
        return cls(backend, meta.get("bos_id"), meta.get("eos_ids", []),
                   bool(meta.get("add_bos", False)), meta.get("chat_template"))

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) stay whole.

        ``add_bos`` None uses the model's default.  No BOS is added when ``text`` already
        starts with it written out (a chat template often writes it); an unknown word that
        encodes as the same id (a tokenizer whose unknown token is its BOS) still gets one.
        """
        if not isinstance(text, str):
            raise InputError(f"text must be a str, got {type(text).__name__}")
        check_text(text, "the text to encode")
        enc = self.backend.encode(text, add_special_tokens=False)
        ids = list(enc.ids)
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise InputError("add_bos=True but this model has no BOS token; pass add_bos=False")
            if not self._bos_written(text, enc):
                ids.insert(0, self.bos_id)
        return ids

    def _bos_written(self, text: str, enc: tokenizers.Encoding) -> bool:
        """Whether the first token is the BOS spelled out in ``text`` (not, say, an unknown
        word that maps to the same id)."""
        if enc.ids[:1] != [self.bos_id]:
            return False
        start, end = enc.offsets[0]
        return text[start:end] == self.token(self.bos_id)

    def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        """Text of ``ids`` (a list or a 1-D integer array)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token(self, token_id: int | None) -> str | None:
        """The vocabulary string of one id (None for None)."""
        return None if token_id is None else self.backend.id_to_token(int(token_id))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: what it adds to the UTF-8 text, even when that is
        part of a character (an emoji split over tokens: ``decode`` of the one token gives
        U+FFFD there).  Byte-level BPE maps its symbols back to bytes; a byte-fallback
        vocabulary's ``<0xNN>`` is byte NN, its other tokens their text ("▁" a space);
        special tokens, and any other decoder, their decoded text."""
        if self._bytes_of is None:
            self._bytes_of = _token_bytes_function(self.backend)
        return self._bytes_of(int(token_id))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's chat template.

        Encode the result with ``add_bos=False`` when the template writes the BOS itself.
        """
        if self.chat_template is None:
            raise InputError("this model has no chat template: give a plain prompt (without "
                             "--chat / chat=True), or a template (--chat-template FILE, "
                             "Tokenizer.set_chat_template)")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m
                                                     for m in messages):
            raise InputError("messages must be a list of {'role', 'content'} dicts, "
                             f"got {messages!r}")
        for i, message in enumerate(messages):
            for key, value in message.items():
                if isinstance(value, str):
                    check_text(value, f"messages[{i}][{key!r}]")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        bos = self.token(self.bos_id) or ""
        eos = (self.token(self.eos_ids[0]) or "") if self.eos_ids else ""
        try:
            return self._template.render(messages=messages, bos_token=bos, eos_token=eos,
                                         add_generation_prompt=add_generation_prompt)
        except Exception as e:  # the template is the model's code: it can raise anything
            raise InputError(f"the model's chat template failed while rendering the messages "
                             f"({type(e).__name__}: {e}); give messages the template accepts "
                             "(roles, order), or a plain prompt, which is not templated "
                             "(paged-run without --chat, /v1/completions)") from e

    def set_chat_template(self, source: str) -> None:
        """Use ``source`` (a Jinja chat template, as in tokenizer_config.json) from now on;
        one that does not parse is an :class:`InputError`."""
        self._template, self.chat_template = check_chat_template(source), source

    def encode_prompt(self, prompt: str, chat: bool = False, what: str = "the prompt"
                      ) -> list[int]:
        """``prompt`` as ids: as it is, or (``chat``) as the user message of the model's chat
        template, rendered with the generation prompt (no second BOS: the template has it)."""
        check_text(prompt, what)
        if chat:
            text = self.apply_chat_template([{"role": "user", "content": prompt}])
            return self.encode(text, add_bos=False)
        return self.encode(prompt)

    def stream(self, skip_special_tokens: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens)


def check_chat_template(source: str) -> jinja2.Template:
    """``source`` compiled; a template that does not parse is an :class:`InputError`."""
    try:
        return _compile_template(source)
    except ArtifactError as e:
        raise InputError(f"the chat template does not parse: {e.__cause__}") from e


def _byte_level_symbols() -> dict[str, int]:
    """Byte-level BPE's printable stand-in of each byte (GPT-2's table), inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    moved = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + i): b for i, b in enumerate(moved)}}


def _token_bytes_function(backend: tokenizers.Tokenizer):
    # the decoder's own state, not the whole tokenizer's JSON: a 262k-token vocabulary's
    # to_str() takes seconds to write and parse
    decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    kinds = {d.get("type") for d in parts}
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}

    def plain(i: int) -> bytes:
        return backend.decode([i], skip_special_tokens=False).encode("utf-8")

    if "ByteLevel" in kinds:
        table = _byte_level_symbols()

        def byte_level(i: int) -> bytes:
            piece = backend.id_to_token(i)
            if i in special or piece is None or any(c not in table for c in piece):
                return plain(i)
            return bytes(table[c] for c in piece)

        return byte_level
    if "ByteFallback" in kinds or "Metaspace" in kinds:
        spaces = [(d["pattern"].get("String"), d["content"]) for d in parts
                  if d.get("type") == "Replace" and d.get("pattern", {}).get("String")]
        if "Metaspace" in kinds:
            spaces.append(("\u2581", " "))

        def byte_fallback(i: int) -> bytes:
            piece = backend.id_to_token(i)
            if i in special or piece is None:
                return plain(i)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            for old, new in spaces:
                piece = piece.replace(old, new)
            return piece.encode("utf-8")

        return byte_fallback
    return plain


def check_text(text: str, what: str) -> None:
    """InputError unless ``text`` is valid Unicode text, i.e. encodes as UTF-8: a lone surrogate
    ("\\ud800"), or a byte of invalid UTF-8 that Python kept as a surrogate escape (a shell
    argument in another encoding), names its position."""
    if not isinstance(text, str):
        raise InputError(f"{what} must be text (a str), got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        kind = (f"the byte 0x{code - 0xDC00:02x} of invalid UTF-8 (kept as a surrogate escape)"
                if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}")
        raise InputError(f"{what} is not valid text: character {e.start} is {kind}; the text "
                         "must be valid UTF-8 (check the terminal's or the file's encoding)"
                         ) from None


def _compile_template(source: str) -> jinja2.Template:
    """The template in a sandbox, with the helpers HF chat templates use."""
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ArtifactError(f"the model's chat template does not parse ({e}); rebuild the "
                            "artifact from a fixed tokenizer config") from e


class StreamDecoder:
    """Incremental detokenisation: ``push`` ids as they are sampled, get only complete text.

    A byte-level token can end inside a UTF-8 character; its text is held back until the
    character completes.  ``"".join(pushes) + flush()`` equals ``decode(all ids)``.  Decoding
    restarts from the previous emitted token (not the start), so a step costs O(1) tokens.
    One decoder per stream: not safe to share between threads.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start: one emitted step back, for context-dependent decoders
        self._read = 0  # ids before this are emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while a character is still partial)."""
        self._ids.append(int(token_id))
        done = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done):]

    def flush(self) -> str:
        """Whatever is still held back (partial characters decode as U+FFFD)."""
        done = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(done):]
