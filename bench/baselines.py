"""Baselines for ``paged-bench`` on the same weights: HF transformers eager and llama.cpp.

Both take our ``params`` dict (``param_specs`` layout) and rebuild the engine's own format from
it: an HF ``LlamaForCausalLM`` state dict, or a GGUF written with the ``gguf`` package (Q/K rows
permuted the way llama.cpp's converter does).  Each timing returns medians, or ``{"skipped":
reason}`` when the engine is not installed.
"""

from __future__ import annotations

import importlib.util
import inspect
import time
from pathlib import Path

import numpy as np

from paged_decode.compile.config import ModelConfig
from paged_decode.compile.params import split_gate_up


def _split_params(cfg: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """Our layout -> HF names (q/k/v and gate/up split back apart)."""
    q, kv = cfg.q_size, cfg.kv_size
    out = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"],
           "lm_head.weight": params["embed" if cfg.tie_word_embeddings else "lm_head"]}
    for i in range(cfg.n_layers):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        wqkv, (gate, up) = params[p + "wqkv"], split_gate_up(params[p + "w_gate_up"])
        out.update({
            h + "input_layernorm.weight": params[p + "input_norm"],
            h + "self_attn.q_proj.weight": wqkv[:q], h + "self_attn.k_proj.weight": wqkv[q:q + kv],
            h + "self_attn.v_proj.weight": wqkv[q + kv:], h + "self_attn.o_proj.weight": params[p + "wo"],
            h + "post_attention_layernorm.weight": params[p + "post_norm"],
            h + "mlp.gate_proj.weight": gate, h + "mlp.up_proj.weight": up,
            h + "mlp.down_proj.weight": params[p + "w_down"]})
    return out


def hf_model(cfg: ModelConfig, params: dict, dtype: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hc = LlamaConfig(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_q_heads,
                     num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                     vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps,
                     rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
                     max_position_embeddings=max(cfg.max_position_embeddings, 2048))
    model = LlamaForCausalLM(hc).eval()
    state = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in
             _split_params(cfg, params).items()}
    model.load_state_dict(state, strict=False)
    return model.to(getattr(torch, dtype))


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter reorders Q/K rows for its interleaved RoPE."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(cfg: ModelConfig, params: dict, path: Path, dtype: str) -> Path:
    """A llama-architecture GGUF of these weights (matrices in ``dtype``, norms float32)."""
    import gguf

    hf = _split_params(cfg, params)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(max(cfg.max_position_embeddings, 2048))
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.n_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_head_count(cfg.n_q_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("none")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for name, value in hf.items():
        gname = names.get(name) or _gguf_layer_name(name)
        arr = np.asarray(value, np.float32)
        if name.endswith("q_proj.weight"):
            arr = _permute(arr, cfg.n_q_heads)
        elif name.endswith("k_proj.weight"):
            arr = _permute(arr, cfg.n_kv_heads)
        w.add_tensor(gname, arr.astype(dtype) if arr.ndim == 2 else arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_layer_name(name: str) -> str:
    parts = name.split(".")
    table = {"input_layernorm": "attn_norm", "q_proj": "attn_q", "k_proj": "attn_k",
             "v_proj": "attn_v", "o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    leaf = parts[-2]
    return f"blk.{parts[2]}.{table[leaf]}.weight"


def hf_forward(model, ids, cache=None):
    """``model(ids)`` with its KV cache carried: (output, the new cache).  transformers 5.2x takes
    and returns the cache as ``cache`` (``past_key_values`` is deprecated there); older versions
    only know ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    out = model(ids, use_cache=True, **({} if cache is None else {name: cache}))
    return out, getattr(out, name)


def time_hf(model, contexts, n_tokens: int, prompt_lens) -> dict:
    """Median ms per decode token at each context, and prefill tokens/s."""
    import torch

    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    out = {"decode_ms": {}, "prefill_tps": {}}
    with torch.inference_mode():
        for ctx in contexts:
            _, past = hf_forward(model, torch.from_numpy(rng.integers(0, vocab, (1, ctx - 1))))
            times = []
            for _ in range(n_tokens + 2):
                t0 = time.perf_counter()
                _, past = hf_forward(model, torch.tensor([[1]]), past)
                times.append(time.perf_counter() - t0)
            out["decode_ms"][ctx] = float(np.median(times[2:]) * 1e3)
        for n in prompt_lens:
            ids = torch.from_numpy(rng.integers(0, vocab, (1, n)))
            model(ids[:, :8])
            t0 = time.perf_counter()
            model(ids, use_cache=True)
            out["prefill_tps"][n] = n / (time.perf_counter() - t0)
    return out


# paged-bench's quantized kinds: llama.cpp's ftype names (its own quantizer makes the file)
LLAMA_FTYPES = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1", "q8_0": "Q8_0",
                "q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M"}


def quantize_gguf(src: Path, out: Path, kind: str, threads: int,
                  requantize: bool = False) -> Path:
    """``src`` (a float16 GGUF) quantized by llama.cpp's ``llama_model_quantize`` to ``kind``
    (a key of ``LLAMA_FTYPES``), so both engines read identical bytes; ``requantize``: ``src``
    may hold quantized tensors (llama.cpp dequantizes them first)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{LLAMA_FTYPES[kind]}")
    params.nthread = threads
    params.allow_requantize = requantize
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src.name} -> {kind}) returned {rc}")
    return out


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def llamacpp_available() -> str | None:
    """None when llama-cpp-python imports, else the reason it cannot be used."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install -e '.[bench]')"
    return None


SWITCH_PAUSE_S = 0.1  # lets the other engine's spinning worker threads park


def pause() -> None:
    """Sleep ``SWITCH_PAUSE_S`` between one engine's timing and another's."""
    time.sleep(SWITCH_PAUSE_S)


def spread(values) -> dict:
    """Median, min, max and the values themselves."""
    return {"median": float(np.median(values)), "min": float(np.min(values)),
            "max": float(np.max(values)), "values": [float(v) for v in values]}


def hf_float32(source):
    """An HF model of ``source``'s float32 weights, torch on every core (for a benchmark's own
    process)."""
    import os

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    return hf_model(source.config, source.load_params("float32"), "float32")


def warm_up(step, warmup_s: float, min_warmup: int = 3) -> None:
    """``min_warmup`` calls of ``step``, continued up to ``warmup_s`` seconds or 48 calls (the
    same warm-up rule for every engine)."""
    t_end = time.perf_counter() + warmup_s
    for i in range(48):
        if i >= min_warmup and time.perf_counter() >= t_end:
            break
        step()


def median_ms(step, n_tokens: int, warmup_s: float, min_warmup: int = 3) -> float:
    """Median ms of ``n_tokens`` calls after the warm-up (``warm_up``)."""
    warm_up(step, warmup_s, min_warmup)
    times = []
    for _ in range(n_tokens):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def time_hf_batched(model, rows, context: int, steps: int) -> dict:
    """``{b: ms per step}``: HF ``generate`` (greedy) on ``b`` prompts of ``context - 1`` tokens,
    the time of ``steps + 1`` new tokens less that of one (the prefill and first token), over
    ``steps``."""
    import torch

    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    out = {}
    with torch.inference_mode():
        for b in rows:
            ids = torch.from_numpy(rng.integers(0, vocab, (b, context - 1)))

            def generate(n):
                t0 = time.perf_counter()
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, pad_token_id=0)
                return time.perf_counter() - t0

            generate(2)  # warm: this batch size's first call
            one, many = generate(1), generate(steps + 1)
            out[b] = max(many - one, 0.0) / steps * 1e3
    return out


class _BatchedLlama:
    """llama.cpp's batch API on a loaded model: a context of ``n_seq`` sequences (``n_seq_max``,
    a KV stream per sequence), each prefilled to ``context - 1`` random tokens; :meth:`step`
    decodes one token for each of the first ``b`` in one ``llama_decode`` call, logits for every
    row (as a serving engine needs them), :meth:`rewind` cuts them back."""

    def __init__(self, llm, n_seq: int, context: int, room: int, threads: int, ggml_type: int):
        import llama_cpp as lc

        self._lc, self.context = lc, context
        p = lc.llama_context_default_params()
        per_seq = -(-(context + room) // 256) * 256  # llama.cpp pads each stream to 256
        p.n_seq_max, p.n_ctx = n_seq, n_seq * per_seq
        p.n_batch = p.n_ubatch = 512
        p.n_threads = p.n_threads_batch = threads
        p.type_k = p.type_v = ggml_type
        p.kv_unified = False
        self.ctx = lc.llama_init_from_model(llm.model, p)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {n_seq} sequences")
        self.batch = lc.llama_batch_init(512, 0, 1)
        self.mem = lc.llama_get_memory(self.ctx)
        rng = np.random.default_rng(0)
        for s in range(n_seq):
            ids = rng.integers(0, llm.n_vocab(), context - 1).tolist()
            for i in range(0, len(ids), 512):
                chunk = ids[i:i + 512]
                self._decode(chunk, range(i, i + len(chunk)), [s] * len(chunk))
        self.pos = [context - 1] * n_seq

    def _decode(self, tokens, positions, seqs, all_logits: bool = False) -> None:
        bt = self.batch
        bt.n_tokens = len(tokens)
        for i, (t, p, s) in enumerate(zip(tokens, positions, seqs)):
            bt.token[i], bt.pos[i], bt.n_seq_id[i] = t, p, 1
            bt.seq_id[i][0] = s
            bt.logits[i] = all_logits or i == len(tokens) - 1
        rc = self._lc.llama_decode(self.ctx, bt)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def step(self, b: int) -> None:
        self._decode([1] * b, self.pos[:b], range(b), all_logits=True)
        for s in range(b):
            self.pos[s] += 1

    def rewind(self, b: int) -> None:
        for s in range(b):
            self._lc.llama_memory_seq_rm(self.mem, s, self.context - 1, -1)
            self.pos[s] = self.context - 1

    def close(self) -> None:
        self._lc.llama_batch_free(self.batch)
        self._lc.llama_free(self.ctx)


def llamacpp_server(conn, gguf_path: str, n_ctx: int, threads: int, cache_dtype: str) -> None:
    """Child-process loop serving timing requests on one loaded llama.cpp model, so rounds of
    ours and llama.cpp can alternate without reloading.  Requests (tuples over ``conn``):
    ``("decode", ctx, n_tokens, warmup_s)`` -> median ms/token with ``ctx - 1`` tokens of context
    (the prompt is evaluated once per ctx and its state restored for later rounds);
    ``("prefill", n)`` -> tokens/s of a second ``n``-token prefill; ``("batch", b, ctx, n_seq,
    n_steps, warmup_s)`` -> median ms of a step decoding one token for each of ``b`` sequences at
    context ``ctx`` (:class:`_BatchedLlama`, made on the first such request for ``n_seq``
    sequences at that context); ``("close",)``."""
    from llama_cpp import Llama

    ggml_type = {"float32": 0, "float16": 1}[cache_dtype]
    rss_before = peak_rss_mb()
    llm = Llama(model_path=gguf_path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False, type_k=ggml_type, type_v=ggml_type)
    rng, vocab, states, batched = np.random.default_rng(0), llm.n_vocab(), {}, None
    llm.eval([1, 2, 3])  # first-call set-up out of the timings
    conn.send("ready")
    while True:
        req = conn.recv()
        if req[0] == "close":
            if batched is not None:
                batched.close()
            conn.close()
            return
        if req[0] == "batch":
            _, b, ctx, n_seq, n_steps, warmup_s = req
            if batched is None:  # room for the warm-up's 48 calls and the timed ones
                batched = _BatchedLlama(llm, n_seq, ctx, 48 + n_steps + 16, threads, ggml_type)
            if (batched.context, len(batched.pos)) != (ctx, n_seq):
                raise ValueError(f"batched requests must keep context {batched.context} and "
                                 f"{len(batched.pos)} sequences (got {ctx}, {n_seq})")
            batched.rewind(n_seq)
            conn.send(median_ms(lambda: batched.step(b), n_steps, warmup_s))
            continue
        if req[0] == "rss":
            conn.send({"peak_rss_mb": peak_rss_mb(), "before_load_mb": rss_before})
            continue
        if req[0] == "decode":
            _, ctx, n_tokens, warmup_s = req
            if ctx not in states:
                llm.reset()
                llm.eval(rng.integers(0, vocab, ctx - 1).tolist())
                states[ctx] = llm.save_state()
            llm.load_state(states[ctx])
            conn.send(median_ms(lambda: llm.eval([1]), n_tokens, warmup_s))
        else:
            _, n = req
            ids = rng.integers(0, vocab, n).tolist()
            llm.reset()
            llm.eval(ids)  # untimed: the first batch of a size after decoding re-plans
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            conn.send(n / (time.perf_counter() - t0))


class LlamaCpp:
    """llama.cpp on a GGUF, in a child process (its thread pool must not share the process with
    ours), serving timing requests until :meth:`close`."""

    def __init__(self, gguf_path: Path, n_ctx: int, threads: int, cache_dtype: str):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=llamacpp_server,
                                 args=(child, str(gguf_path), n_ctx, threads, cache_dtype),
                                 daemon=True)
        self._proc.start()
        self._call_reply()

    def _call_reply(self, *req):
        if req:
            self._conn.send(req)
        if not self._conn.poll(3600):
            raise TimeoutError("llama.cpp child did not answer within an hour")
        try:
            return self._conn.recv()
        except EOFError:
            raise RuntimeError(f"llama.cpp child exited (code {self._proc.exitcode})") from None

    def decode_ms(self, ctx: int, n_tokens: int, warmup_s: float) -> float:
        return self._call_reply("decode", ctx, n_tokens, warmup_s)

    def prefill_tps(self, n: int) -> float:
        return self._call_reply("prefill", n)

    def batch_ms(self, b: int, ctx: int, n_seq: int, n_steps: int, warmup_s: float) -> float:
        return self._call_reply("batch", b, ctx, n_seq, n_steps, warmup_s)

    def rss(self) -> dict:
        """The child's peak RSS so far and its RSS before loading the model, MB."""
        return self._call_reply("rss")

    def close(self) -> None:
        if self._proc.is_alive():
            self._conn.send(("close",))
            self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
