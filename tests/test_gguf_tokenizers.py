"""GGUF byte-level vocabularies split as their own tokenizer.json does (``tokenizer.ggml.pre``):
the ids equal transformers' tokenizer loaded from the same GGUF file."""

import gguf
import pytest

from paged_decode.compile import tokenizer_export
from paged_decode.compile.weights import gguf_fields

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
