"""SentencePiece vocabularies of GGUF files (``tokenizer.ggml.model = llama``: Llama 2, Gemma,
Phi-3) as a ``tokenizers`` BPE with byte fallback.

Built as transformers builds a tokenizer from the same file (its GGUF integration), so the ids
agree: the merges are recovered from the vocabulary (a SentencePiece GGUF stores scores, not
merges), ranked by the merged token's score; Gemma's by the token's position instead, since its
scores do not follow its merge order.  Control tokens (``<start_of_turn>``) are special added
tokens, user-defined ones (``\\n\\n``, ``<table>``) plain added tokens, both matched whole.
"""

from __future__ import annotations

import logging

from paged_decode.runtime.errors import ConfigError

log = logging.getLogger(__name__)

SPACE = "\u2581"  # SentencePiece's visible space
# GGUF token types (llama.cpp's llama_token_type)
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4
_GEMMA = frozenset({"gemma", "gemma2", "gemma3"})
# llama.cpp takes a control token of one of these names as the end of a turn when the file names
# no eot_token_id (llama-vocab.cpp); a chat model stops there, not only at the EOS
_EOT_NAMES = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "<end_of_utterance>")


def spm_tokenizer(fields: dict, source: str):
    """The ``tokenizers.Tokenizer`` of a SentencePiece GGUF vocabulary (``fields``: metadata)."""
    from tokenizers import Tokenizer, models

    arch = fields.get("general.architecture")
    tokens = fields.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ConfigError(f"{source}: tokenizer.ggml.model='llama' (SentencePiece) but the GGUF "
                          "metadata has no tokenizer.ggml.tokens; convert the model again with "
                          "llama.cpp's convert_hf_to_gguf.py")
    tokens, priority = _spelling_and_priority(tokens, fields, arch, source)
    vocab = {t: i for i, t in enumerate(tokens)}  # a repeated spelling keeps its last id
    unk = _token(tokens, fields.get("tokenizer.ggml.unknown_token_id")) if arch in _GEMMA else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=spm_merges(vocab, priority), fuse_unk=True,
                               byte_fallback=True, dropout=None, unk_token=unk))
    _set_pipeline(tok, arch, fields.get("tokenizer.ggml.add_space_prefix"))
    _add_special_tokens(tok, fields, vocab, arch)
    return tok


def _spelling_and_priority(tokens: list[str], fields: dict, arch, source: str):
    """The tokens as the model looks them up, and each token's merge priority (higher first)."""
    if arch in _GEMMA:
        # Gemma files store a token of blanks with real spaces; the text it matches is spelled
        # with SPACE by the time the model sees it
        tokens = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        return tokens, {t: -i for i, t in enumerate(tokens)}
    scores = fields.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ConfigError(f"{source}: a SentencePiece vocabulary needs tokenizer.ggml.scores, one "
                          f"per token ({len(tokens)}); got "
                          f"{'none' if scores is None else len(scores)}; convert the model again "
                          "with llama.cpp's convert_hf_to_gguf.py")
    return tokens, dict(zip(tokens, (float(s) for s in scores)))


def spm_merges(vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary tokens, best merged token first.

    Ties (one token, several splits) go shorter left part first, then shorter right part, then
    lower ids: the order transformers' ``generate_merges`` gives, so the BPE ranks match."""
    merges = []
    for merged, score in priority.items():
        local = [(merged[:k], merged[k:]) for k in range(1, len(merged))
                 if merged[:k] in vocab and merged[k:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges.extend((left, right, score) for left, right in local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _set_pipeline(tok, arch, add_space_prefix) -> None:
    """Normalizer, pre-tokenizer and decoder of the family's SentencePiece setup."""
    from tokenizers import decoders, normalizers, pre_tokenizers

    to_text = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if arch in _GEMMA:  # no dummy prefix; spaces spelled SPACE before the model
        tok.normalizer = normalizers.Replace(" ", SPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence(to_text)
        return
    # transformers always prepends the dummy space here; a file that says it has none is read
    # as llama.cpp reads it (no prefix), which is how such a vocabulary was trained
    prefix = add_space_prefix is not False
    if arch == "phi3" and prefix:  # Phi-3: the prefix space comes from a normalizer
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE),
                                               normalizers.Replace(" ", SPACE)])
        tok.pre_tokenizer = None
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE, prepend_scheme="first" if prefix else "never", split=False)
    strip = [decoders.Strip(content=" ", left=1)] if prefix else []
    tok.decoder = decoders.Sequence(to_text + strip)


def _add_special_tokens(tok, fields: dict, vocab: dict[str, int], arch) -> None:
    """BOS / EOS / UNK / PAD and every control token as special tokens; user-defined tokens as
    plain added tokens (in the vocabulary's spelling only: a token of blanks is matched by the
    model, not as an added token)."""
    from tokenizers import AddedToken

    tokens = fields["tokenizer.ggml.tokens"]
    types = fields.get("tokenizer.ggml.token_type") or []
    named = [_token(tokens, fields.get(f"tokenizer.ggml.{k}_token_id"))
             for k in ("bos", "eos", "unknown", "padding")]
    if arch in _GEMMA:
        named.append("<mask>")
    special = [t for t in named if t is not None and t in vocab]
    special += [t for t, ty in zip(tokens, types) if ty == CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in dict.fromkeys(special)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED and t in vocab])


def _token(tokens: list[str], token_id) -> str | None:
    return tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else None


def stop_ids(fields: dict) -> list[int]:
    """EOS, EOT and EOM ids as the file names them; without an EOT id, the control token that
    llama.cpp takes for one by its name (Gemma's ``<end_of_turn>``)."""
    ids = [fields.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    if ids[1] is None:
        tokens = fields.get("tokenizer.ggml.tokens") or []
        types = fields.get("tokenizer.ggml.token_type") or []
        by_name = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL}
        ids += [by_name[name] for name in _EOT_NAMES if name in by_name]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))
