"""``paged-bench --section speculative``: one stream's decode speed with and without prompt
lookup speculative decoding, paired (the two alternate within every round), on input-grounded
tasks (summarise, rewrite, edit code given in the prompt) and free generation (greedy and at
temperature 0.7), with the acceptance rate and whether greedy output stayed identical; then 16
streams at once through the batching engine, with and without.

The texts are this package's own documentation and source, so the run needs nothing else."""

from __future__ import annotations

import inspect
import statistics
import time

ROUNDS_FULL, ROUNDS_QUICK = 3, 1
NEW_TOKENS = 160
STREAMS = 16
TEXT_TOKENS = 600  # about: the given text of the grounded tasks


def _text() -> str:
    """English prose of about ``TEXT_TOKENS`` tokens: module documentation of the runtime."""
    from paged_decode.runtime import batch_engine, prefix_cache, scheduler, session

    docs = [inspect.getdoc(m) for m in (scheduler, session, batch_engine, prefix_cache)]
    return "\n\n".join(docs)[:TEXT_TOKENS * 4]


def _code() -> str:
    from paged_decode.runtime import block_allocator

    return inspect.getsource(block_allocator)[:TEXT_TOKENS * 3]


def tasks() -> list[dict]:
    text, code = _text(), _code()
    grounded = [("summarise", f"Summarise the following text in a few sentences.\n\n{text}"),
                ("rewrite", "Rewrite the following text in plain words, keeping every point "
                 f"in the same order.\n\n{text}"),
                ("edit code", "Rename the class BlockAllocator to BlockPool in this Python "
                 f"code and return the whole file.\n\n```python\n{code}\n```")]
    free = "Write a long story about a lighthouse keeper and a storm."
    return ([dict(name=n, prompt=p, kind="grounded", temperature=0.0) for n, p in grounded]
            + [dict(name="free, greedy", prompt=free, kind="free", temperature=0.0),
               dict(name="free, t=0.7", prompt=free, kind="free", temperature=0.7)])


def _one(engine, ids, task, seed) -> dict:
    from paged_decode.runtime.sampling import SamplingParams

    params = SamplingParams(temperature=task["temperature"], seed=seed)
    t0 = time.perf_counter()
    tokens = list(engine.stream_ids(ids, NEW_TOKENS, params, engine.tokenizer.eos_ids))
    s = engine.stats
    return dict(tokens=tokens, wall_s=time.perf_counter() - t0,
                tps=s.decode_tokens_per_s, drafted=s.drafted_tokens, accepted=s.accepted_tokens)


def _stream_rows(plain, spec, rounds, say, only=None) -> list[dict]:
    out = []
    for task in [t for t in tasks() if only is None or t["name"] in only]:
        ids = plain.tokenizer.encode_prompt(task["prompt"], True, "prompt")
        runs = {"off": [], "on": []}
        for r in range(rounds):
            for mode, engine in (("off", plain), ("on", spec))[::1 if r % 2 == 0 else -1]:
                runs[mode].append(_one(engine, ids, task, seed=r))
        off, on = runs["off"], runs["on"]
        drafted = sum(x["drafted"] for x in on)
        row = dict(task=task["name"], kind=task["kind"], prompt_tokens=len(ids),
                   tokens=statistics.median(len(x["tokens"]) for x in on),
                   off_tps=statistics.median(x["tps"] for x in off),
                   on_tps=statistics.median(x["tps"] for x in on),
                   acceptance=sum(x["accepted"] for x in on) / drafted if drafted else 0.0,
                   identical=(all(a["tokens"] == b["tokens"] for a, b in zip(off, on))
                              if task["temperature"] == 0 else None))
        row["speedup"] = row["on_tps"] / row["off_tps"] if row["off_tps"] else None
        if task["temperature"] == 0:
            row["ceiling"] = ceiling(ids, off[0]["tokens"], spec.scheduler.speculative)
        row["verify_cost"] = verify_costs(spec.scheduler.runner)
        say(f"  {task['name']}: {row['off_tps']:.1f} -> {row['on_tps']:.1f} tokens/s "
            f"({row['speedup']:.2f}x), acceptance {row['acceptance']:.0%}"
            + (f", ceiling {row['ceiling']:.2f}x" if "ceiling" in row else ""))
        out.append(row)
    return out


def ceiling(prompt: list[int], tokens: list[int], config) -> float:
    """The speed-up the drafter would give on this greedy output if a verification cost what a
    decode does: tokens over the steps it takes when every step verifies the drafter's whole
    proposal (``config.draft_tokens`` at most) and keeps its agreeing prefix plus one token.
    What the drafter finds bounds any verification kernel."""
    from paged_decode.runtime.speculative import NgramDrafter

    if config.method != "ngram" or not tokens:
        return float("nan")
    drafter, i, steps = NgramDrafter(config), 0, 0
    while i < len(tokens):
        proposal = drafter.propose(prompt + tokens[:i], config.draft_tokens)
        agree = 0
        while (agree < len(proposal) and i + agree < len(tokens)
               and proposal[agree] == tokens[i + agree]):
            agree += 1
        i, steps = i + agree + 1, steps + 1
    return len(tokens) / steps


def verify_costs(runner) -> dict[int, float]:
    """A call's mean time per plan (token rows), over the decode's: what a verification costs."""
    one = runner.seconds.get(1)
    return {rows: s / one for rows, s in sorted(runner.seconds.items()) if rows > 1 and one}


def _batched(prepared, speculative, say) -> dict:
    """Tokens / s of ``STREAMS`` streams at once (every task's prompt in turn), on and off."""
    from paged_decode.runtime.batch_engine import BatchEngine
    from paged_decode.runtime.sampling import SamplingParams

    prompts = [t["prompt"] for t in tasks()]
    prompts = [prompts[i % len(prompts)] for i in range(STREAMS)]
    out = {}
    for mode, spec in (("off", None), ("on", speculative), ("off2", None)):
        with BatchEngine.load(prepared.artifact_dir, prepared.weights_dir,
                              speculative=spec) as engine:
            t0 = time.perf_counter()
            streams = [engine.submit(p, chat=True, max_new_tokens=NEW_TOKENS // 2,
                                     sampling=SamplingParams()) for p in prompts]
            for s in streams:
                s.wait()
            n = sum(len(s.tokens) for s in streams)
            out[mode] = n / (time.perf_counter() - t0)
    out["off"] = statistics.mean([out.pop("off"), out.pop("off2")])  # on, between two offs
    out["ratio"] = out["on"] / out["off"]
    say(f"  {STREAMS} streams: {out['off']:.1f} -> {out['on']:.1f} tokens/s "
        f"({out['ratio']:.2f}x)")
    return out


def run_speculative(model: str | None, rounds: int, artifacts, say) -> dict:
    from paged_decode.compile.api import prepare
    from paged_decode.runtime.artifact import load_artifact, load_weights
    from paged_decode.runtime.engine import Engine
    from paged_decode.runtime.kv_pool import PagedKVCache
    from paged_decode.runtime.speculative import SpeculativeConfig
    from paged_decode.runtime.tokenizer import Tokenizer

    prepared = prepare(model, artifacts=artifacts)
    artifact = load_artifact(prepared.artifact_dir)
    weights = load_weights(prepared.weights_dir, artifact)
    tokenizer = Tokenizer.from_dir(prepared.weights_dir)
    config = SpeculativeConfig()

    def engine(spec):
        pool = PagedKVCache.for_artifact(artifact, num_blocks=artifact.max_blocks_cap)
        return Engine(artifact, weights, pool, tokenizer, speculative=spec)

    say(f"speculative decoding: {prepared.manifest.name}, ngram, draft_tokens "
        f"{config.draft_tokens}")
    rows = _stream_rows(engine(None), engine(config), rounds, say)
    return dict(model=prepared.manifest.name, draft_tokens=config.draft_tokens,
                new_tokens=NEW_TOKENS, rounds=rounds, streams=rows,
                batched=_batched(prepared, config, say),
                draft=_draft_rows(model, rounds, artifacts, say))


def _draft_rows(model, rounds, artifacts, say) -> dict:
    """The model's weights in float16 as the target, its own formats as the draft model: one
    tokenizer, a draft about 3x faster per token."""
    from paged_decode.compile.api import prepare
    from paged_decode.runtime.artifact import load_artifact, load_weights
    from paged_decode.runtime.draft_model import DraftModel
    from paged_decode.runtime.engine import Engine
    from paged_decode.runtime.kv_pool import PagedKVCache
    from paged_decode.runtime.speculative import SpeculativeConfig
    from paged_decode.runtime.tokenizer import Tokenizer

    target = prepare(model, artifacts=artifacts, weight_dtype="float16")
    small = prepare(model, artifacts=artifacts)
    artifact = load_artifact(target.artifact_dir)
    weights = load_weights(target.weights_dir, artifact)
    tokenizer = Tokenizer.from_dir(target.weights_dir)
    config = SpeculativeConfig(method="draft", draft_tokens=4, draft_model=DraftModel.load(
        small.artifact_dir, small.weights_dir))

    def engine(spec):
        pool = PagedKVCache.for_artifact(artifact, num_blocks=artifact.max_blocks_cap)
        return Engine(artifact, weights, pool, tokenizer, speculative=spec)

    say(f"draft model: {small.manifest.name} drafting for its float16 weights")
    rows = _stream_rows(engine(None), engine(config), rounds, say,
                        only=("rewrite", "free, greedy", "free, t=0.7"))
    return dict(target=f"{target.manifest.name} float16", draft=small.manifest.name,
                draft_tokens=config.draft_tokens, streams=rows)


def markdown(runs: list[dict]) -> list[str]:
    lines = []
    for run in runs:
        lines += ["", f"### Speculative decoding (prompt lookup), {run['model']}", "",
                  f"One stream, greedy unless said, {run['new_tokens']} new tokens at most, "
                  f"median of {run['rounds']} paired rounds; decode tokens / s.", "",
                  "| task | prompt tokens | off | on | speedup | acceptance | identical | "
                  "ceiling |", "|---|---|---|---|---|---|---|---|"]
        for r in run["streams"]:
            same = {True: "yes", False: "NO", None: "(sampled)"}[r["identical"]]
            top = f"{r['ceiling']:.2f}x" if r.get("ceiling") is not None else "-"
            lines.append(f"| {r['task']} | {r['prompt_tokens']} | {r['off_tps']:.1f} | "
                         f"{r['on_tps']:.1f} | {r['speedup']:.2f}x | {r['acceptance']:.0%} | "
                         f"{same} | {top} |")
        costs = run["streams"][-1].get("verify_cost") if run["streams"] else None
        lines += ["", "Ceiling: the speed-up if a verification cost one decode (the drafter's "
                  "proposals on the greedy output, every one verified whole)."]
        if costs:
            lines.append("A call over B token rows costs " + ", ".join(
                f"{c:.2f}x (B = {b})" for b, c in costs.items()) + " a decode.")
        b = run["batched"]
        lines += ["", f"{STREAMS} streams at once (batching engine): {b['off']:.1f} tokens/s "
                  f"without, {b['on']:.1f} with ({b['ratio']:.2f}x)."]
        d = run.get("draft")
        if d:
            lines += ["", f"Draft model {d['draft']} for {d['target']} (up to "
                      f"{d['draft_tokens']} drafted tokens):", "",
                      "| task | off | on | speedup | acceptance | identical |",
                      "|---|---|---|---|---|---|"]
            lines += [f"| {r['task']} | {r['off_tps']:.1f} | {r['on_tps']:.1f} | "
                      f"{r['speedup']:.2f}x | {r['acceptance']:.0%} | "
                      f"{ {True: 'yes', False: 'NO', None: '(sampled)'}[r['identical']]} |"
                      for r in d["streams"]]
    return lines
