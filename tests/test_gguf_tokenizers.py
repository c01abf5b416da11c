"""GGUF vocabularies as transformers reads the same file: byte-level BPE split as its own
tokenizer.json does (``tokenizer.ggml.pre``), and SentencePiece (``tokenizer.ggml.model =
llama``: Gemma 3 270M's real 262,144-token file, and a small Llama-2-style vocabulary written
here the way llama.cpp's converter writes one).  The ids equal transformers' tokenizer loaded
from the same GGUF file; a family's chat template stands in for a missing one."""

import logging
import re
from collections import Counter

import gguf
import pytest

from paged_decode.compile import chat_templates, config, tokenizer_export
from paged_decode.compile.weights import ModelSource, gguf_fields
from paged_decode.runtime.errors import ConfigError
from paged_decode.runtime.tokenizer import Tokenizer

# digits in runs (Qwen2: one token per digit, Llama 3: up to three), contractions in any case,
# line breaks and trailing blanks: where the split expressions differ from GPT-2's
TEXTS = ["I'm 12345 ok\n\n  x", "Don'T 3.14159 ½ 🙂\r\nab  ", "hello world, it's 2024!"]
PRES = ["qwen2", "llama-bpe"]


@pytest.fixture(scope="module")
def smollm_fields(smollm_gguf):
    return gguf_fields(smollm_gguf)


def _write(path, fields, pre: str):
    """A GGUF holding only the metadata of SmolLM2's vocabulary, stated as ``pre``'s."""
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(fields["tokenizer.ggml.tokens"])
    w.add_token_types(fields["tokenizer.ggml.token_type"])
    w.add_token_merges(fields["tokenizer.ggml.merges"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("pre", PRES)
def test_split_vocabularies_encode_as_transformers(smollm_fields, tmp_path, pre):
    from transformers import AutoTokenizer

    _write(tmp_path / "tok.gguf", smollm_fields, pre)
    hf = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    ours = tokenizer_export._gguf_tokenizer({**smollm_fields, "tokenizer.ggml.pre": pre}, "x")
    gpt2 = tokenizer_export._gguf_tokenizer({**smollm_fields, "tokenizer.ggml.pre": "gpt2"}, "x")
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text
    # the split matters for these texts: GPT-2's expression gives other ids
    assert any(ours.encode(t, add_special_tokens=False).ids
               != gpt2.encode(t, add_special_tokens=False).ids for t in TEXTS)


# unicode, emoji (one grapheme of several code points), CJK, blank runs shorter and longer than
# Gemma's longest blank token (31), tabs, newlines, leading blanks, digits, special-token text
CORPUS = [
    "", " ", "   ", "\n", "\t", "Hello world", "The capital of France is", "trailing  ",
    "runs     of      spaces", "a" + " " * 20 + "b", "a" + " " * 40 + "b", "tabs\tand\t\ttabs",
    "new\nlines\n\n\nand\r\nCRLF", "\n\nstarts with newlines", "ends with a newline\n",
    "digits 0123456789 3.14159 1,000,000", "naïve café résumé Ångström ß",
    "日本語のテキストと中文文本和한국어", "emoji 🙂🎉👩‍👩‍👧 👍🏽 flags 🇫🇷", "math ∑ x² ≤ ∞ ½",
    "code:\n    def f(x):\n\treturn x**2  # comment", "\u00a0non-breaking\u2009thin\u200bzero",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "a<eos>b <bos>c",
    "<s>the</s> the", "<unk> <pad> <mask>", "not <special> nor <start_of_turn",
    "<table><tr><td>cell</td></tr></table>", "'quotes' \"double\" `back`", "z" * 300,
]


def _train_bpe(text: str, n_merges: int) -> tuple[list[str], list[str]]:
    """SentencePiece-style BPE on ``text``: words carry a leading "\u2581"; the most frequent
    adjacent pair merges first.  Returns (merged pieces in merge order, characters by count)."""
    words = Counter("\u2581" + w for w in text.split())
    split = {w: list(w) for w in words}
    pieces: list[str] = []
    for _ in range(n_merges):
        pairs = Counter()
        for w, n in words.items():
            pairs.update({pair: n for pair in zip(split[w], split[w][1:])})
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        pieces.append(a + b)
        for w, parts in split.items():
            merged, i = [], 0
            while i < len(parts):
                take = i + 1 < len(parts) and (parts[i], parts[i + 1]) == (a, b)
                merged.append(a + b if take else parts[i])
                i += 2 if take else 1
            split[w] = merged
    chars = [c for c, _ in Counter("".join(words.elements())).most_common()]
    return pieces, chars


TRAIN_TEXT = " ".join(CORPUS[5:20] * 3) + " the theory of these three things is that there then"


def _write_spm(path, arch="llama", add_space_prefix=True):
    """A Llama-2-style SentencePiece vocabulary as llama.cpp's converter stores one: <unk>
    (UNKNOWN), <s> </s> (CONTROL), the 256 byte tokens (BYTE), then pieces (NORMAL) scored by
    merge order and single characters after them; no merges."""
    pieces, chars = _train_bpe(TRAIN_TEXT, 200)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, *chars]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) + len(chars))
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces) + len(chars))]
    w = gguf.GGUFWriter(path, arch)
    for add, value in [(w.add_block_count, 1), (w.add_context_length, 64),
                       (w.add_embedding_length, 8), (w.add_feed_forward_length, 8),
                       (w.add_head_count, 1), (w.add_head_count_kv, 1)]:
        add(value)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(add_space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _exported(gguf_path, out) -> Tokenizer:
    """The runtime's tokenizer of a GGUF, through the build's export."""
    export_tokenizer = tokenizer_export.export_tokenizer
    export_tokenizer(ModelSource("gguf", gguf_path, config.preset("tiny"), "0" * 16), out)
    return Tokenizer.from_dir(out)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_sentencepiece_vocabulary_encodes_as_transformers(tmp_path, arch):
    from transformers import AutoTokenizer

    _write_spm(tmp_path / "tok.gguf", arch)
    hf = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tok.gguf")
    ours = _exported(tmp_path / "tok.gguf", tmp_path / "out")
    assert (ours.bos_id, ours.eos_ids, ours.add_bos, ours.chat_template) == (1, [2], True, None)
    for text in CORPUS:
        if not text.startswith("<s>"):  # written out, the BOS is not added again (encode)
            assert ours.encode(text) == hf.encode(text), text  # with transformers' BOS
        ids = ours.encode(text, add_bos=False)
        assert ids == hf.encode(text, add_special_tokens=False), text
        # what transformers' ids cannot give back: Llama's " x" has the ids of "x" (no dummy
        # space before a blank), Phi-3 puts a dummy space after each special token too
        lossy = text.startswith(" ") if arch == "llama" else any(
            s in text for s in ("<s>", "</s>", "<unk>"))
        if not lossy:
            assert ours.decode(ids) == text, text
    ids = ours.encode("<s>the</s>", add_bos=False)
    assert (ids[0], ids[-1], ids.count(1) + ids.count(2)) == (1, 2, 2)  # matched whole
    assert any(i > 258 + 30 for i in ours.encode("the theory", add_bos=False))  # merges apply


@pytest.fixture(scope="module")
def gemma3_tokenizers(gemma3_gguf, tmp_path_factory):
    """(ours through the export, transformers' from the same file, the export's log)."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("gemma3-tok")
    logger = logging.getLogger(tokenizer_export.__name__)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        ours = _exported(gemma3_gguf, out)
    finally:
        logger.removeHandler(handler)
    hf = AutoTokenizer.from_pretrained(gemma3_gguf.parent, gguf_file=gemma3_gguf.name)
    return ours, hf, [r.getMessage() for r in records]


def test_gemma3_vocabulary_encodes_as_transformers(gemma3_tokenizers):
    ours, hf, _ = gemma3_tokenizers
    assert ours.vocab_size == 262144
    for text in CORPUS:
        assert ours.encode(text) == hf.encode(text), text  # BOS (2) first: add_bos_token
        ids = ours.encode(text, add_bos=False)
        assert ours.decode(ids) == text, text
        # each token's own bytes (streamed logprobs) add up to the text: "\u2581" runs, <0x..>
        assert b"".join(ours.token_bytes(i) for i in ids) == text.encode(), text
    assert ours.encode("", add_bos=True) == [2]
    # control and user-defined tokens are matched whole; byte fallback for what has no piece
    assert ours.encode("<start_of_turn>\n\n", add_bos=False) == [105, 108]
    pieces = [ours.token(i) for i in ours.encode("\ue2af", add_bos=False)]
    assert pieces == ["<0xEE>", "<0x8A>", "<0xAF>"]


def test_gemma3_stop_ids_and_family_chat_template(gemma3_tokenizers, gemma3_gguf):
    ours, hf, log_lines = gemma3_tokenizers
    assert ours.eos_ids == [hf.eos_token_id, hf.convert_tokens_to_ids("<end_of_turn>")] == [1, 106]
    assert hf.chat_template is None  # the base model's file has none; the family's is used
    assert [m for m in log_lines if "chat template" in m] == [
        f"{gemma3_gguf}: no chat template in the file; using the gemma family template"]
    text = ours.apply_chat_template([{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi "},
                                     {"role": "assistant", "content": "Hello."},
                                     {"role": "user", "content": "Bye"}])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    ids = ours.encode_prompt("Hi", chat=True)
    assert ids == hf.encode("<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
                            add_special_tokens=False)
    assert ids[:2] == [2, 105] and ids.count(2) == 1


def test_family_template_only_where_the_file_has_none():
    base = {"general.architecture": "gemma2", "tokenizer.ggml.model": "llama"}
    assert tokenizer_export._gguf_chat_template(base, "x") == chat_templates.GEMMA
    own = {**base, "tokenizer.chat_template": "{{ messages[0]['content'] }}"}
    assert tokenizer_export._gguf_chat_template(own, "x") == own["tokenizer.chat_template"]
    assert tokenizer_export._gguf_chat_template({**base, "general.architecture": "llama"},
                                                "x") is None


def test_sentencepiece_vocabulary_without_scores_is_refused(tmp_path):
    fields = gguf_fields(_write_spm(tmp_path / "tok.gguf"))
    del fields["tokenizer.ggml.scores"]
    with pytest.raises(ConfigError, match="tokenizer.ggml.scores, one per token"):
        tokenizer_export._gguf_tokenizer(fields, "tok.gguf")


# Where transformers' ids, which these follow, and llama.cpp's differ, by design of each.  Llama
# 2 style: llama.cpp puts the dummy space before a text that starts with a blank and after every
# special token (as SentencePiece on the whole text would); transformers' Metaspace does
# neither.  Gemma: llama.cpp matches its blank-run tokens whole, longest first (31 + rest);
# transformers merges a run of 32 or more blanks from pairs (16 + 16 + ...).
LLAMA_CPP_DIFFERS = {
    ("llama", True): lambda text: re.search(r"^ |(<s>|</s>|<unk>)[^<]", text) is not None,
    ("llama", False): lambda text: False,  # the file's add_space_prefix=false, as llama.cpp
    ("phi3", True): lambda text: False,
    ("gemma3", False): lambda text: " " * 32 in text,
}


@pytest.mark.parametrize("arch, prefix", list(LLAMA_CPP_DIFFERS), ids=lambda v: str(v))
def test_sentencepiece_ids_against_llama_cpp(tmp_path, arch, prefix, request):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the bench extra) "
                                    "is not installed")
    if arch == "gemma3":  # the exported tokenizer, as the runtime reads it
        path, ours = request.getfixturevalue("gemma3_gguf"), request.getfixturevalue(
            "gemma3_tokenizers")[0].backend
    else:
        path = _write_spm(tmp_path / "tok.gguf", arch, prefix)
        ours = tokenizer_export._gguf_tokenizer(gguf_fields(path), str(path))
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    differ = [text for text in CORPUS if ours.encode(text, add_special_tokens=False).ids
              != ref.tokenize(text.encode(), add_bos=False, special=True)]
    assert differ == [text for text in CORPUS if LLAMA_CPP_DIFFERS[arch, prefix](text)]
