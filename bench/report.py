"""Writes a ``paged-bench`` report as JSON, a Markdown table and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def _fmt(x, digits=2):
    return "—" if x is None else f"{x:.{digits}f}"


def _fmt_spread(d: dict, digits: int = 2) -> str:
    out = f"{d['median']:.{digits}f} ({d['min']:.{digits}f}-{d['max']:.{digits}f})"
    return out + (f" [{d['stable']}/{d['pairs']}]" if "stable" in d else "")


def _regime_cells(by_ctx: dict, contexts) -> str:
    """``median (pairs)`` per context and regime from a ``{ctx: _by_regime(...)}`` mapping."""
    cells = []
    for c in contexts:
        by = by_ctx[c]
        cells += [f"{by[k]['median']:.2f} ({by[k]['pairs']})" if k in by else "—"
                  for k in ("fast", "slow")]
    return " | ".join(cells)


def _regime_lines(report: dict, contexts) -> list[str]:
    """Decode ratios and floor fractions split by bandwidth regime, for runs that saw both."""
    runs = [r for r in report["runs"] if r.get("regime_split_gbps")]
    if not runs:
        return []
    head = " | ".join(f"ctx {c} fast | ctx {c} slow" for c in contexts) + " |"
    rule = "---|---|" * len(contexts)
    lines = ["", "Split by bandwidth regime (stable pairs whose mean reading is above / below "
             "the split, the geometric mean of the run's lowest and highest reading; number of "
             "pairs in brackets; — : no stable pair in that regime).", ""]
    with_lc = [r for r in runs if "vs_llamacpp" in r["ours"]]
    if with_lc:
        lines += ["Ours over llama.cpp, tokens/s:", "",
                  "| model | dtype | split GB/s | " + head, "|---|---|---|" + rule]
        lines += [f"| {r['model']} | {r['dtype']} | {r['regime_split_gbps']:.1f} | "
                  + _regime_cells(r["ours"]["vs_llamacpp"]["decode_by_regime"], contexts) + " |"
                  for r in with_lc]
        lines.append("")
    lines += ["Fraction of the bandwidth floor (each pair against its own readings):", "",
              "| model | dtype | split GB/s | engine | " + head, "|---|---|---|---|" + rule]
    for r in runs:
        for name, res in {"paged-decode": r["ours"], **r["baselines"]}.items():
            if "floor_fraction_by_regime" in res:
                lines.append(f"| {r['model']} | {r['dtype']} | {r['regime_split_gbps']:.1f} | "
                             f"{name} | "
                             + _regime_cells(res["floor_fraction_by_regime"], contexts) + " |")
    return lines


def _regime_pair(by: dict) -> str:
    """``fast / slow`` medians of one ``_by_regime`` mapping (— where a regime had no pair)."""
    return " / ".join(f"{by[k]['median']:.2f}" if k in by else "—" for k in ("fast", "slow"))


def _weights_read_lines(report: dict, contexts) -> list[str]:
    """The read-only step: its floor fraction and our step over it, per run."""
    runs = [r for r in report["runs"] if "weights_read" in r["ours"]]
    if not runs:
        return []
    lines = ["", "Read-only step: in every pair, the weight matrices a decode step streams, each "
             "read by a read-only kernel of its own in the artifact's parameter order (the step "
             "without its arithmetic, attention, KV cache and host work). Its fraction of the "
             "floor for its bytes (every context's pairs together), and our step over it; median "
             "(min-max) [pairs stable with their read-only reading too / all pairs], then fast / "
             "slow regime medians where the run saw both:", "",
             "| model | dtype | MB | read-only: floor fraction | fast / slow | "
             + " | ".join(f"ours / read-only ctx {c} | fast / slow" for c in contexts) + " |",
             "|---|---|---|---|---|" + "---|---|" * len(contexts)]
    for r in runs:
        w = r["ours"]["weights_read"]
        cells = [_fmt_spread(w["floor_fraction"]), _regime_pair(w["floor_fraction_by_regime"])]
        for c in contexts:
            cells += [_fmt_spread(w["ours_over"][c]), _regime_pair(w["ours_over_by_regime"][c])]
        lines.append(f"| {r['model']} | {r['dtype']} | {w['bytes'] / 1e6:.1f} | "
                     + " | ".join(cells) + " |")
    return lines


def _engine_rows(run: dict, contexts) -> list[str]:
    rows = []
    engines = {"paged-decode": run["ours"], **run["baselines"]}
    for name, res in engines.items():
        if "skipped" in res:
            rows.append(f"| {run['model']} | {run['dtype']} | {name} | skipped: {res['skipped']} "
                        + "| " * (len(contexts) + 1) + "|")
            continue
        ms = [res["decode_ms"].get(c) for c in contexts]
        if "floor_fraction" in res:  # each stable pair against its own bandwidth readings
            ratio = [res["floor_fraction"][c]["median"] for c in contexts]
        else:
            ratio = [run["floor_ms"][c] / m if m else None for c, m in zip(contexts, ms)]
        tps = res.get("prefill_tps", {})
        rows.append(f"| {run['model']} | {run['dtype']} | {name} | "
                    + " | ".join(f"{_fmt(m)} ({_fmt(r)})" for m, r in zip(ms, ratio))
                    + " | " + ", ".join(f"{n}: {v:.0f}" for n, v in tps.items()) + " |")
    return rows


def _rss(res: dict) -> str:
    r = res.get("peak_rss_mb")
    return f"{r['peak_rss_mb']:.0f} MB ({r['before_load_mb']:.0f} before loading)" if r else "—"


def _memory_lines(report: dict) -> list[str]:
    """Weight formats and each engine's peak resident memory (its own process: load, a prefill
    of the longest prompt, decode)."""
    lines = ["", "Weights and peak resident memory (each engine in a process of its own):", "",
             "| model | dtype | our weight formats | ours peak RSS | llama.cpp peak RSS |",
             "|---|---|---|---|---|"]
    for run in report["runs"]:
        o, lc = run["ours"], run["baselines"].get("llama.cpp", {})
        w = o.get("weights", {})
        counts: dict[str, int] = {}
        for k, v in w.items():
            if k != "weight_dtype":
                counts[v] = counts.get(v, 0) + 1
        formats = w.get("weight_dtype", "?") + "".join(
            f"; {n} matrices {f}" for f, n in sorted(counts.items()))
        lines.append(f"| {run['model']} | {run['dtype']} | {formats} | {_rss(o)} | {_rss(lc)} |")
    return lines


def _cell(d: dict | None, digits: int = 2) -> str:
    return "—" if d is None else _fmt_spread(d, digits)


def _batch_lines(report: dict) -> list[str]:
    """The batched section: per run, tokens/s per b against the roofs and the baselines, and
    the goals."""
    lines = []
    for r in report.get("batch_runs", []):
        groups = [g for gs in r["groups"].values() for g in gs]
        bw = [x for g in groups for x in g["bandwidth_gbps"]]
        peak = [x for g in groups for x in g["fma_gflops"]]
        lc = r.get("llama.cpp", {})
        hf = r["hf_ms"]
        lines += ["", f"Batched decode, {r['model']} {r['dtype']}: b sequences at context "
                  f"{r['context']}, one token each per step. Roofs measured in the run: read "
                  f"bandwidth {np.median(bw):.1f} GB/s ({min(bw):.1f}-{max(bw):.1f}), float32 "
                  f"FMA peak {np.median(peak):.0f} GFLOP/s ({min(peak):.0f}-{max(peak):.0f}); "
                  "a point's roof is b / max(bytes / bandwidth, flops / peak) at its group's "
                  "readings. Ours tokens/s: median of every reading; over b = 1: the medians' "
                  "ratio (in brackets: the median over rounds of each round's b against its "
                  "b = 1); fractions and ratios: median (min-max) over the groups (each times "
                  "ours, llama.cpp, ours back to back)."
                  + (f" llama.cpp: skipped ({lc['skipped']})." if "skipped" in lc else "")
                  + (f" HF: skipped ({hf['skipped']})." if "skipped" in hf else ""), "",
                  "| b | ours tok/s | over b = 1 (per round) | roof tok/s (bound) | ours / roof | "
                  "llama.cpp tok/s | ours / llama.cpp | llama.cpp / roof | HF generate tok/s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for b, row in r["per_b"].items():
            lines.append(
                f"| {b} | {row['tps']:.0f} | {_fmt(row['over_b1'])} "
                f"({_fmt((row['over_b1_per_round'] or {}).get('median'))}) | {row['roof_tps']:.0f} "
                f"({row['bound']}) | {_cell(row['roof_fraction'])} | "
                f"{_fmt(row.get('llama.cpp_tps'), 0)} | {_cell(row.get('vs_llamacpp'))} | "
                f"{_cell(row.get('llama.cpp_roof_fraction'))} | {_fmt(row.get('hf_tps'), 0)} |")
        host = r.get("host_sampling")
        if host:
            lines += ["", f"Host sampling per step at b = {host['b']} (one step's logits, each "
                      "row its own seeded sampler, as the scheduler samples): " + ", ".join(
                          f"{kind} {ms:.2f} ms ({host['fraction'][kind]:.1%} of the step)"
                          for kind, ms in host["ms"].items()) + "."]
        if r["goals"]:
            lines += ["", "Goals: " + "; ".join(
                f"{name} >= {g['goal']:g}: {g['got']:.2f} ({'met' if g['met'] else 'not met'})"
                for name, g in r["goals"].items()) + "."]
    return lines


def _machine_line(report: dict) -> str:
    machine = report["machine"]
    return (f"CPU: {machine.get('cpu_model') or 'unknown'} "
            f"({' '.join(machine.get('vector_extensions') or []) or 'extensions unknown'}), "
            f"{machine['cpu_count']} cores.")


def markdown(report: dict) -> str:
    lines = [_machine_line(report)]
    if report["runs"]:
        lines += ["", *_decode_lines(report)]
    lines += _batch_lines(report)
    lines += _serve_lines(report)
    from .start import markdown as start_lines

    lines += start_lines(report.get("start_runs", []))
    from .speculative import markdown as speculative_lines

    lines += speculative_lines(report.get("speculative_runs", []))
    return "\n".join(lines) + "\n"


def _serve_lines(report: dict) -> list[str]:
    """The serving section: per run, bench/serve.py's tables (its own serve.* files beside)."""
    lines = []
    for r in report.get("serve_runs", []):
        head = f"Serving, {r['model']} {r['dtype']}"
        if "skipped" in r:
            lines += ["", f"{head}: skipped ({r['skipped']})."]
        else:
            lines += ["", f"{head} (serve-{r['model']}-{r['dtype']}/serve.json, .md, .png):",
                      "", r["markdown"]]
    return lines


def _decode_lines(report: dict) -> list[str]:
    contexts = report["settings"]["contexts"]
    bws = ", ".join(f"{r['model']} {r['dtype']}: {r['bandwidth_gbps']:.1f} "
                    f"({min(r['bandwidth_samples']):.1f}-{max(r['bandwidth_samples']):.1f})"
                    for r in report["runs"])
    blocks = sorted({r["block_size"] for r in report["runs"]})
    lines = [f"Read bandwidth (GB/s, median (min-max) of the readings): {bws}.  KV-cache blocks "
             f"of {' / '.join(map(str, blocks))} tokens.", "",
             "ms/token at context, median of all readings (fraction of the bandwidth floor: "
             "median over the stable pairs, each against its own bandwidth readings, or over "
             "all pairs where none was stable); prefill tokens/s by prompt length.", "",
             "| model | dtype | engine | " + " | ".join(f"ctx {c}" for c in contexts)
             + " | prefill tok/s |",
             "|---|---|---|" + "---|" * len(contexts) + "---|"]
    for run in report["runs"]:
        lines += [f"| {run['model']} | {run['dtype']} | floor | "
                  + " | ".join(_fmt(run["floor_ms"][c]) for c in contexts) + " | |"]
        lines += _engine_rows(run, contexts)
    lines += ["", "Ours over llama.cpp (tokens/s ratio; decode: median (min-max) over the pairs "
              "that stayed in one bandwidth regime, [stable/all pairs]; [0/n]: none did, the "
              "median is over all n; each pair times ours, "
              "llama.cpp, ours back to back; prefill: per round; paged/contiguous: a scattered "
              "over an identity block table at the largest context, their tokens timed "
              "alternately, median (min-max) over every pair):", "",
              "| model | dtype | compile s | load s (cache hit) | paged/contiguous | "
              "re-plan/plan-once | " + " | ".join(f"decode ctx {c}" for c in contexts)
              + " | prefill |", "|---|---|---|---|---|---|" + "---|" * len(contexts) + "---|"]
    for run in report["runs"]:
        o = run["ours"]
        vs = o.get("vs_llamacpp")
        dec = [_fmt_spread(vs["decode"][c]) if vs else "—" for c in contexts]
        pre = ", ".join(f"{p}: {_fmt_spread(v)}" for p, v in vs["prefill"].items()) if vs else "—"
        lines.append(f"| {run['model']} | {run['dtype']} | {_fmt(o['compile_seconds'], 1)} | "
                     f"{_fmt(o['load_seconds'])} | {_fmt_spread(o['paged_vs_contiguous'], 3)} | "
                     f"{_fmt(o['replan']['ratio'], 1)} | " + " | ".join(dec) + f" | {pre} |")
    lines += _memory_lines(report)
    lines += _regime_lines(report, contexts)
    lines += _weights_read_lines(report, contexts)
    for run in report["runs"]:
        if "host_overhead" in run["ours"]:
            h = run["ours"]["host_overhead"]
            lines += ["", f"Host overhead ({run['model']} {run['dtype']}, contexts "
                      f"{h['context']}-{h['context'] + 32}): whole Python step "
                      f"{h['python_step_us']:.1f} µs, VM call (time evaluator) "
                      f"{h['vm_call_us']:.1f} µs, Python part {h['python_overhead_us']:.1f} µs."]
    return lines


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, batched = report["runs"], report.get("batch_runs", [])
    spec = report.get("speculative_runs", [])
    n = max(len(runs), len(batched), len(spec), 1)
    rows = [x for x in (runs, batched, spec) if x] or [[]]  # serving only: its own serve.png
    fig, axes = plt.subplots(len(rows), n, figsize=(4.5 * n, 3.8 * len(rows)), squeeze=False)
    for ax in axes.flat[:]:
        ax.set_axis_off()
    for ax, run in zip(axes[-1] if spec else [], spec):
        ax.set_axis_on()
        names = [r["task"] for r in run["streams"]] + ["16 streams"]
        ratios = [r["speedup"] or 0 for r in run["streams"]] + [run["batched"]["ratio"]]
        ax.bar(range(len(ratios)), ratios)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(ratios)), names, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("tokens / s, on / off")
        ax.set_title(f"{run['model']}: speculative (ngram)")
    for ax, run in zip(axes[len(rows) - 1 - bool(spec)] if batched else [], batched):
        ax.set_axis_on()
        bs = [int(b) for b in run["per_b"]]
        per_b = list(run["per_b"].values())
        ax.plot(bs, [p["roof_tps"] for p in per_b], "k--", label="roof")
        ax.plot(bs, [p["tps"] for p in per_b], "o-", label="paged-decode")
        for key, name in (("llama.cpp_tps", "llama.cpp"), ("hf_tps", "HF generate")):
            if all(p.get(key) for p in per_b):
                ax.plot(bs, [p[key] for p in per_b], "o-", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{run['model']} {run['dtype']}, batched")
        ax.set_xlabel("sequences per step (b)")
        ax.set_ylabel("tokens / s")
        ax.legend(fontsize=7)
    for ax, run in zip(axes[0] if runs else [], runs):
        ax.set_axis_on()
        ctx = sorted(run["floor_ms"], key=int)
        ax.plot(ctx, [run["floor_ms"][c] for c in ctx], "k--", label="bandwidth floor")
        for name, res in {"paged-decode": run["ours"], **run["baselines"]}.items():
            if "decode_ms" in res:
                ax.plot(ctx, [res["decode_ms"][c] for c in ctx], "o-", label=name)
        ax.set_xscale("log")
        ax.set_title(f"{run['model']} {run['dtype']}")
        ax.set_xlabel("context length")
        ax.set_ylabel("ms / token")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def write_outputs(report: dict, out_dir: Path) -> dict:
    paths = {"json": out_dir / "bench.json", "md": out_dir / "bench.md", "png": out_dir / "bench.png"}
    md = markdown(report)
    paths["json"].write_text(json.dumps(_jsonable(report), indent=1))
    paths["md"].write_text(md)
    plot(report, paths["png"])
    return {**{k: str(v) for k, v in paths.items()}, "markdown": md}
