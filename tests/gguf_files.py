"""Pieces of the GGUF files the tests write as llama.cpp's converter would (each test file
adds its family's own keys and tensors between them)."""

from __future__ import annotations


def shape_keys(w, cfg, *, value_length: bool = True) -> None:
    """llama.cpp's keys for the shape of ``cfg`` (a ModelConfig), under the writer's arch."""
    w.add_block_count(cfg.n_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.n_q_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    if value_length:
        w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def byte_vocabulary(w, vocab_size: int) -> None:
    """A byte-level ('gpt2') vocabulary of ``vocab_size`` tokens, so the file loads as a model."""
    w.add_tokenizer_model("gpt2")
    alphabet = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    w.add_token_list(alphabet + [f"<{i}>" for i in range(vocab_size - len(alphabet))])


def finish(w, path):
    """Write the header, the metadata and the tensors; ``path``."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
