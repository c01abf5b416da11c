"""``paged-bench --section batch``: aggregate decode throughput of batched steps against the
machine's two roofs, llama.cpp's batch API and HF transformers' batched ``generate``.

Every sequence sits at the same context length.  Each round, for each b: a bracketed group
(bandwidth and FMA peak readings, our step over b sequences, llama.cpp's step over b sequences
(``n_seq_max`` sequences, one ``llama_decode`` of b tokens), ours again, the roofs again);
ratios are taken within a group, so a bandwidth regime flip between groups moves both engines.
HF ``generate`` runs once per b after the rounds, in a process of its own.
"""

from __future__ import annotations

import numpy as np

from . import baselines
from .baselines import median_ms, spread
from .roofs import (kv_bytes, measure_bandwidth, measure_fma_peak, roof_tps, step_cost,
                    streamed_bytes)

ROWS = (1, 2, 4, 8, 16, 32)
FULL = dict(rows=ROWS, context=128, steps=16, rounds=3, bw_mb=512, warmup_s=0.3)
QUICK = dict(rows=(1, 2), context=16, steps=4, rounds=1, bw_mb=64, warmup_s=0.05)
# the goals, checked in the report: b = 8 and b = 32 over b = 1, b = 16 over llama.cpp
# and against the roof
GOALS = {"over_b1": {8: 4.0, 32: 8.0}, "vs_llamacpp": {16: 2.0}, "roof_fraction": {16: 0.6}}
# the sampling a serving step adds on the host, per kind of request parameters
SAMPLING = {"greedy": {}, "temperature 1": {"temperature": 1.0},
            "top_p 0.95": {"temperature": 0.8, "top_p": 0.95},
            "top_k 40": {"temperature": 0.8, "top_k": 40}}


class OursBatched:
    """Our batched step over ``max(rows)`` sequences of one pool, each prefilled to ``context -
    1`` tokens a block at a time in turn (so each sequence's blocks sit among the others', as
    in a server); :meth:`step_ms` times the bucket holding the first ``b``."""

    def __init__(self, prepared, rows, context: int, steps: int):
        from paged_decode.runtime.artifact import load_artifact, load_weights
        from paged_decode.runtime.kv_pool import PagedKVCache
        from paged_decode.runtime.step import BatchDecodeSession

        self.artifact = load_artifact(prepared.artifact_dir)
        self.weights = load_weights(prepared.weights_dir, self.artifact)
        m, self.context = self.artifact.manifest, context
        missing = sorted(set(rows) - set(m.batch_buckets) - {1})
        if missing:
            raise ValueError(f"the artifact has no batch bucket for b = {missing} (buckets "
                             f"{list(m.batch_buckets)}); build it with --batch-buckets that "
                             "cover them")
        per_seq = -(-(context + 48 + steps + 8) // m.block_size)
        self.pool = PagedKVCache.for_artifact(self.artifact, num_blocks=per_seq * max(rows))
        self.session = BatchDecodeSession(self.artifact, self.weights, self.pool)
        rng = np.random.default_rng(0)
        self.seqs = [self.pool.new_sequence() for _ in range(max(rows))]
        prompts = [rng.integers(0, m.vocab_size, context - 1).tolist() for _ in self.seqs]
        for start in range(0, context - 1, m.block_size):
            for h, ids in zip(self.seqs, prompts):
                self.session._single.prefill(h, ids[start:start + m.block_size])

    def _rewind(self, b: int) -> None:
        for h in self.seqs[:b]:
            h.truncate_to(self.context - 1)

    def logits(self, b: int) -> np.ndarray:
        """One step's logits ``[b, vocab_size]`` (the sequences stay as they were)."""
        try:
            return self.session.step(self.seqs[:b], [1] * b)
        finally:
            self._rewind(b)

    def step_ms(self, b: int, steps: int, warmup_s: float) -> float:
        handles, tokens = self.seqs[:b], [1] * b
        try:
            return median_ms(lambda: self.session.step(handles, tokens), steps, warmup_s)
        finally:
            self._rewind(b)


def host_sampling(ours: OursBatched, b: int, step_ms: float, repeats: int) -> dict:
    """The host work sampling adds to a serving step of ``b`` rows: one step's logits sampled
    as the scheduler samples them (``sample_rows``, each row its own seeded sampler), for each
    kind in :data:`SAMPLING`; median ms and its fraction of the step (``step_ms``)."""
    from paged_decode.runtime.sampling import Sampler, SamplingParams, sample_rows

    logits = ours.logits(b)
    out = {"b": b, "step_ms": step_ms, "ms": {}, "fraction": {}}
    for kind, params in SAMPLING.items():
        samplers = [Sampler(SamplingParams(seed=i, **params)) for i in range(b)]
        ms = median_ms(lambda: sample_rows(samplers, logits), repeats, 0.0)
        out["ms"][kind], out["fraction"][kind] = ms, ms / step_ms
    return out


def _roofs(cfg: dict) -> dict:
    return {"bandwidth_gbps": measure_bandwidth(cfg["bw_mb"]), "fma_gflops": measure_fma_peak()}


def _group(ours: OursBatched, lc, b: int, cfg: dict, n_seq: int, cost: dict) -> dict:
    """One bracketed group at ``b``: roofs, ours, llama.cpp, ours, roofs; the group's roof from
    its mean readings."""
    before = _roofs(cfg)
    warm = cfg["warmup_s"]
    g = {"ours_ms": [ours.step_ms(b, cfg["steps"], warm)]}
    if lc is not None:
        baselines.pause()  # our worker threads park before llama.cpp's run, and its after
        g["llama.cpp_ms"] = lc.batch_ms(b, cfg["context"], n_seq, cfg["steps"], warm)
        baselines.pause()
    g["ours_ms"].append(ours.step_ms(b, cfg["steps"], warm))
    after = _roofs(cfg)
    g["bandwidth_gbps"] = [before["bandwidth_gbps"], after["bandwidth_gbps"]]
    g["fma_gflops"] = [before["fma_gflops"], after["fma_gflops"]]
    g["roof"] = roof_tps(cost, b, float(np.mean(g["bandwidth_gbps"])),
                         float(np.mean(g["fma_gflops"])))
    return g


def _tps(b: int, ms: float) -> float:
    return b / (ms / 1e3)


def summarize(groups: dict, hf: dict | None) -> dict:
    """Per b: our tokens/s (median over every reading), over b = 1 (the medians' ratio, and
    per round against that round's b = 1 group: median (min-max); None without b = 1), the
    fraction of each group's roof and the ratio to llama.cpp within each group (median
    (min-max) over the groups), llama.cpp's and HF's tokens/s; and the goals met or not."""
    def geo_tps(b, g):
        return _tps(b, float(np.sqrt(np.prod(g["ours_ms"]))))

    ones = groups.get(1)
    base = float(np.median([_tps(1, ms) for g in ones for ms in g["ours_ms"]])) if ones else None
    per_b = {}
    for b, gs in groups.items():
        ours = float(np.median([_tps(b, ms) for g in gs for ms in g["ours_ms"]]))
        geo = [geo_tps(b, g) for g in gs]
        row = {"tps": ours, "over_b1": ours / base if base else None,
               "over_b1_per_round": (spread([t / geo_tps(1, one) for t, one in zip(geo, ones)])
                                     if ones else None),
               "roof_tps": float(np.median([g["roof"]["tps"] for g in gs])),
               "bound": gs[0]["roof"]["bound"],
               "roof_fraction": spread([t / g["roof"]["tps"] for t, g in zip(geo, gs)])}
        if all("llama.cpp_ms" in g for g in gs):
            lc = [_tps(b, g["llama.cpp_ms"]) for g in gs]
            row["llama.cpp_tps"] = float(np.median(lc))
            row["vs_llamacpp"] = spread([t / lt for t, lt in zip(geo, lc)])
            row["llama.cpp_roof_fraction"] = spread(
                [lt / g["roof"]["tps"] for lt, g in zip(lc, gs)])
        if hf and b in hf:
            row["hf_tps"] = _tps(b, hf[b]) if hf[b] > 0 else None
        per_b[b] = row
    goals = {}
    for kind, want in GOALS.items():
        for b, target in want.items():
            if b not in per_b or (kind == "vs_llamacpp" and "vs_llamacpp" not in per_b[b]):
                continue
            got = per_b[b][kind]
            got = got["median"] if isinstance(got, dict) else got
            if got is None:
                continue
            goals[f"{kind} b={b}"] = {"goal": target, "got": got, "met": got >= target}
    return {"per_b": per_b, "goals": goals}


def _hf_batch_child(source, rows, context: int, steps: int) -> dict:
    return baselines.time_hf_batched(baselines.hf_float32(source), rows, context, steps)


def run_batch(prepared, source, dtype: str, cfg: dict, lc, say, in_child, hf=None) -> dict:
    """The batched section for one model x dtype (``lc``: a started ``baselines.LlamaCpp`` or
    None; ``in_child(fn, *args)`` runs HF in a process of its own; ``hf``: HF's timings from an
    earlier dtype of the same model, reused: HF runs float32 whatever the dtype)."""
    import importlib.util

    rows = tuple(cfg["rows"])
    ours = OursBatched(prepared, rows, cfg["context"], cfg["steps"])
    m = ours.artifact.manifest
    weights, kv = streamed_bytes(m, ours.weights), kv_bytes(m, cfg["context"])
    costs = {b: step_cost(source.config, b, cfg["context"], weights, kv) for b in rows}
    groups = {b: [] for b in rows}
    for r in range(cfg["rounds"]):
        say(f"  batched round {r + 1}/{cfg['rounds']}")
        for b in rows:
            groups[b].append(_group(ours, lc, b, cfg, max(rows), costs[b]))
    if hf is not None:
        say("  HF transformers batched generate: as measured for the model's first dtype")
    elif importlib.util.find_spec("transformers") is None:
        hf = {"skipped": "transformers is not installed (pip install -e '.[bench]')"}
    else:
        say("  HF transformers batched generate (float32)")
        hf = in_child(_hf_batch_child, source, rows, cfg["context"], cfg["steps"])
    out = summarize(groups, hf if "skipped" not in hf else None)
    top = max(rows)
    sampling = host_sampling(ours, top, top / out["per_b"][top]["tps"] * 1e3, cfg["steps"])
    return {"context": cfg["context"], "rows": list(rows), "costs": costs, "groups": groups,
            "hf_ms": hf, "host_sampling": sampling, **out}
