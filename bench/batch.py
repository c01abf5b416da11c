"""Aggregate decode throughput of batched steps: tokens/s at b = 1, 2, 4, ... sequences per step.

``python -m paged_decode.bench.batch --model llama-160m --dtype float16`` prints a Markdown
table: per b, the median step time over rounds, the aggregate tokens/s and its ratio to b = 1.
Every sequence sits at the same context length; the steps of one round run back to back on a
pool holding all of them (each sequence's blocks scattered among the others').
"""

from __future__ import annotations

import argparse
import time

import numpy as np

ROWS = (1, 2, 4, 8, 16, 32)


def measure(prepared, rows=ROWS, context: int = 128, steps: int = 16, rounds: int = 3) -> dict:
    """``{b: median seconds per step}`` for each ``b`` in ``rows``."""
    from paged_decode.runtime.artifact import load_artifact, load_weights
    from paged_decode.runtime.kv_pool import PagedKVCache
    from paged_decode.runtime.step import BatchDecodeSession

    artifact = load_artifact(prepared.artifact_dir)
    weights = load_weights(prepared.weights_dir, artifact)
    bs = artifact.block_size
    per_seq = -(-(context + steps * rounds + 8) // bs)
    pool = PagedKVCache.for_artifact(artifact, num_blocks=per_seq * max(rows))
    session = BatchDecodeSession(artifact, weights, pool)
    rng = np.random.default_rng(0)
    vocab = artifact.manifest.vocab_size
    seqs = [pool.new_sequence() for _ in range(max(rows))]
    for h in seqs:  # interleaved growth: each sequence's blocks scattered among the others'
        session._single.prefill(h, rng.integers(0, vocab, context).tolist())
    out = {}
    for b in rows:
        handles, tokens = seqs[:b], [1] * b
        session.step(handles, tokens)  # warm: the bucket's plan is built here
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(steps):
                session.step(handles, tokens)
            times.append((time.perf_counter() - t0) / steps)
        for h in handles:
            h.truncate_to(context)
        out[b] = float(np.median(times))
    return out


def table(model: str, dtype: str, result: dict) -> str:
    base = 1 / result[min(result)]
    lines = [f"{model} {dtype}: aggregate decode throughput",
             "", "| b | ms / step | tokens/s | over b = 1 |", "|---|---|---|---|"]
    for b, sec in result.items():
        lines.append(f"| {b} | {sec * 1e3:.2f} | {b / sec:.0f} | {b / sec / base:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from paged_decode.compile.api import prepare

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-160m")
    ap.add_argument("--dtype", default="float16", choices=("float32", "float16"))
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--artifacts", default=None)
    args = ap.parse_args(argv)
    prepared = prepare(args.model, max_context=1024, cache_dtype=args.dtype,
                       weight_dtype=args.dtype, artifacts=args.artifacts)
    print(table(args.model, args.dtype, measure(prepared, context=args.context)))


if __name__ == "__main__":
    main()
