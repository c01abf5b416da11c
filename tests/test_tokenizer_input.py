"""Tokenizer export and input: BOS as the tokenizer itself adds it (reference: transformers'
PreTrainedTokenizerFast on the same saved folder), prompts that are not valid text, and chat
templates that fail while rendering, each a typed error naming the problem."""

from __future__ import annotations

import json
import os

import pytest

from paged_decode.compile import config
from paged_decode.compile.tokenizer_export import export_tokenizer
from paged_decode.compile.weights import ModelSource
from paged_decode.runtime.errors import ConfigError, InputError
from paged_decode.runtime.tokenizer import Tokenizer

VOCAB = {"<s>": 0, "</s>": 1, "hello": 2, "world": 3, "the": 4, "fox": 5}
TEXTS = ["hello world", "the fox", "an unknown word", "a", "hello <s> world"]


def word_tokenizer(unk: str, post_bos: bool):
    """A word-level tokenizer; ``post_bos``: its post-processor prepends <s> (id 0)."""
    from tokenizers import Tokenizer as Backend, models, pre_tokenizers, processors

    tok = Backend(models.WordLevel(vocab=VOCAB, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    if post_bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", 0)])
    return tok


def save_folder(path, backend, **tokenizer_config):
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    tcfg = {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast",
            **tokenizer_config}
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return path


def exported(folder, out) -> Tokenizer:
    export_tokenizer(ModelSource("hf", folder, config.preset("tiny"), "0" * 16), out)
    return Tokenizer.from_dir(out)


@pytest.mark.parametrize("unk, post_bos, tokenizer_config", [
    ("<s>", False, {}),  # the unknown token is the BOS: "a" encodes as [0] without any BOS
    ("<s>", True, {}),
    ("</s>", False, {}),
    ("</s>", True, {}),
    ("<s>", False, {"add_bos_token": True}),  # transformers 5: tokenizer.json decides
    ("</s>", True, {"add_bos_token": False}),
], ids=["unk-is-bos", "unk-is-bos+post-bos", "plain", "post-bos", "config-says-bos",
        "config-says-no-bos"])
def test_bos_as_transformers_adds_it(tmp_path, unk, post_bos, tokenizer_config):
    from transformers import PreTrainedTokenizerFast

    folder = save_folder(tmp_path / "model", word_tokenizer(unk, post_bos), unk_token=unk,
                         **tokenizer_config)
    ours = exported(folder, tmp_path / "out")
    ref = PreTrainedTokenizerFast.from_pretrained(folder)
    assert ours.add_bos == post_bos and ours.bos_id == 0
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text


def test_bos_of_the_byte_bpe_fixture_matches_transformers(llama_ckpt, tmp_path):
    from transformers import PreTrainedTokenizerFast

    ours = exported(llama_ckpt.path, tmp_path)
    ref = PreTrainedTokenizerFast.from_pretrained(llama_ckpt.path)
    for text in ["hello world", "the lazy dog", "zzz"]:
        assert ours.encode(text) == ref.encode(text), text


def test_post_processor_bos_other_than_bos_token_is_refused(tmp_path):
    folder = save_folder(tmp_path / "model", word_tokenizer("</s>", True), bos_token="hello")
    with pytest.raises(ConfigError, match=r"post-processor prepends \[0\], not the one BOS token "
                                          r"\(bos_token id 2\)"):
        exported(folder, tmp_path / "out")


def test_chat_template_file_wins_as_in_transformers(tmp_path):
    from transformers import PreTrainedTokenizerFast

    folder = save_folder(tmp_path / "model", word_tokenizer("</s>", False),
                         chat_template="config:{{ messages[0]['content'] }}")
    (folder / "chat_template.jinja").write_text("file:{{ messages[0]['content'] }}")
    messages = [{"role": "user", "content": "hello"}]
    ref = PreTrainedTokenizerFast.from_pretrained(folder).apply_chat_template(
        messages, tokenize=False)
    assert ref == "file:hello"
    assert exported(folder, tmp_path / "out").apply_chat_template(messages) == ref


@pytest.mark.parametrize("name, data, message", [
    ("tokenizer_config.json", b"{not json", r"tokenizer_config\.json: not a readable JSON file"),
    ("tokenizer_config.json", b"[1]", r"tokenizer_config\.json: holds a JSON list, not an object"),
    ("generation_config.json", b"\xff\xfe", r"generation_config\.json: not a readable JSON"),
    ("tokenizer.json", b'{"version": "1.0"}', r"tokenizer\.json: not a readable tokenizer"),
    ("chat_template.jinja", b"\xff{{ x }}", r"chat_template\.jinja: not readable UTF-8 text"),
])
def test_damaged_tokenizer_files_are_config_errors(tmp_path, name, data, message):
    folder = save_folder(tmp_path / "model", word_tokenizer("</s>", False))
    (folder / name).write_bytes(data)
    with pytest.raises(ConfigError, match=message):
        exported(folder, tmp_path / "out")


# ------------------------------------------------------------------------------- bad prompts

@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    root = tmp_path_factory.mktemp("tok")
    folder = save_folder(root / "model", word_tokenizer("</s>", True),
                         chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return exported(folder, root / "out")


@pytest.mark.parametrize("text, message", [
    ("\ud800", r"the text to encode is not valid text: character 0 is a lone surrogate U\+D800"),
    ("hello \udfff", r"character 6 is a lone surrogate U\+DFFF"),
    (os.fsdecode(b"caf\xe9 world"), r"character 3 is the byte 0xe9 of invalid UTF-8"),
    (b"\xff\xfe".decode("utf-8", "surrogateescape"), r"character 0 is the byte 0xff"),
])
def test_prompt_that_is_not_valid_text_is_an_input_error(tok, text, message):
    with pytest.raises(InputError, match=message + r".*must be valid UTF-8"):
        tok.encode(text)
    with pytest.raises(InputError, match=r"messages\[1\]\['content'\] is not valid text"):
        tok.apply_chat_template([{"role": "system", "content": "ok"},
                                 {"role": "user", "content": text}])


@pytest.mark.parametrize("template, error", [
    ("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
    ("{{ messages[0]['content'] + 1 }}", "TypeError: "),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError: "),
    ("{{ raise_exception('roles must alternate') }}", "TemplateError: roles must alternate"),
    ("{{ messages.append(1) }}", "SecurityError: "),
    ("{{ messages | tojson(separators=1) }}", "TypeError: "),
], ids=["zero-division", "type", "recursion", "raise_exception", "sandbox", "filter-args"])
def test_chat_template_failing_while_rendering_is_an_input_error(tok, template, error):
    broken = Tokenizer(tok.backend, tok.bos_id, tok.eos_ids, tok.add_bos, template)
    with pytest.raises(InputError, match=r"the model's chat template failed while rendering the "
                                         rf"messages \({error}.*or a plain prompt"):
        broken.apply_chat_template([{"role": "user", "content": "hello"}])


def test_valid_prompts_still_encode(tok):
    assert tok.encode("hello world") == [0, 2, 3]
    assert tok.encode("héllo 🙂", add_bos=False) == [1, 1]  # unknown words
    assert tok.apply_chat_template([{"role": "user", "content": "the fox"}]) == "the fox"


def byte_fallback_backend(llama2: bool = False):
    """A SentencePiece-style vocabulary: "▁" for spaces, ``<0xNN>`` for bytes of characters it
    does not hold; ``llama2``: as Llama 2's tokenizer.json, a "▁" put before the text and
    stripped again from the decoded text's start."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for piece in ("\u2581", "a", "b", "\u2581a", "\u00e9"):
        vocab[piece] = len(vocab)
    backend = Backend(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if llama2 else "never")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if llama2 else []))
    return backend


def test_token_bytes_of_a_byte_fallback_vocabulary():
    tok = Tokenizer(byte_fallback_backend(), None, [], False, None)
    text = "ab a\u00e9 \U0001F600\u4e2d"
    ids = tok.encode(text)
    assert any(tok.token(i).startswith("<0x") for i in ids)  # the emoji went to bytes
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    assert tok.token_bytes(0) == tok.decode([0]).encode("utf-8")  # <unk>: its text
