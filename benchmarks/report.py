"""Results: JSON (the record), markdown tables and a PNG plot; merging of partial runs.

A result file is ``{"meta": {...}, "runs": {run_id: meta}, "rows": [...]}``; every row carries the
``run_id`` of the process that measured it. Ratios (× FLA-graph, × jla) are always taken between
rows of the same run and the same (shape, op): the machines are noisy, numbers from different
processes are not compared. Merging keeps, for each (shape, op), the group of rows from the newest
run that measured it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

FLA_GRAPH = "FLA graph"
JLA = "jla mosaic_gpu"
PHASES = ("fwd", "bwd", "fwdbwd")
OP_TITLES = {"deltanet": "DeltaNet", "gdn": "GDN", "kda": "KDA", "gdn2": "GDN2"}


def _num(x):
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def add_derived(rows: list[dict]) -> list[dict]:
    """Fill bwd = fwd+bwd − fwd, % of floor, and ratios to FLA-graph and jla (same run, shape, op).
    A ratio whose same-run reference row is absent (dropped by a merge) keeps its stored value."""
    groups = {}
    for r in rows:
        groups.setdefault((r.get("run_id"), r["shape"], r["op"]), []).append(r)
    for grp in groups.values():
        refs = {r["impl"]: r for r in grp}
        for r in grp:
            t = r.setdefault("ms", {})
            if _num(t.get("fwd")) and _num(t.get("fwdbwd")):
                t["bwd"] = t["fwdbwd"] - t["fwd"]
            fl = r.get("floor") or {}
            r["pct_of_floor"] = {ph: (100.0 * t[ph] / fl[ph]["ms"]) if _num(t.get(ph)) and ph in fl
                                 and fl[ph]["ms"] > 0 else None for ph in PHASES}
            for key, ref_name in (("vs_fla_graph", FLA_GRAPH), ("vs_jla", JLA)):
                if ref_name not in refs and r.get(key):
                    continue
                ref = refs.get(ref_name, {}).get("ms", {})
                r[key] = {ph: (t[ph] / ref[ph]) if _num(t.get(ph)) and _num(ref.get(ph)) and ref[ph] > 0
                          else None for ph in PHASES}
    return rows


def write_json(path: Path, result: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, sort_keys=False, default=float))
    tmp.replace(path)


def merge(results: list[dict]) -> dict:
    """Merge result dicts (oldest first). Per (shape, op, impl) the newest row wins; a row that was
    skipped in a newer run does not replace a measured one. Ratios stay those of each row's own run."""
    latest, runs, metas = {}, {}, []
    for res in results:
        metas.append(res.get("meta", {}))
        runs.update(res.get("runs", {}))
        for r in add_derived([dict(x) for x in res.get("rows", [])]):
            k = (r["shape"], r["op"], r["impl"])
            if k in latest and latest[k].get("status") == "ok" and r.get("status") != "ok":
                continue
            latest[k] = r
    order = {}
    for k in latest:
        order.setdefault((k[0], k[1]), []).append(latest[k])
    rows = [r for k in sorted(order, key=_group_order) for r in order[k]]
    meta = dict(metas[-1]) if metas else {}
    if len(metas) > 1:
        meta["merged_from"] = [m.get("command", "?") for m in metas]
        # parts may run under different versions (gpu_run.sh gives GDN/GDN2's processes a newer
        # Triton for FLA): each version that any part ran under is named
        versions = {}
        for m in metas:
            for k, v in m.get("versions", {}).items():
                versions.setdefault(k, [])
                if v not in versions[k]:
                    versions[k].append(v)
        meta["versions"] = {k: " / ".join(v) for k, v in versions.items()}
    return {"meta": meta, "runs": runs, "rows": add_derived(rows)}


def _group_order(key):
    from benchmarks.shapes import FULL_SHAPES, OPS

    shape, op = key
    keys = [s.key() for s in FULL_SHAPES]
    return (keys.index(shape) if shape in keys else len(keys), shape,
            OPS.index(op) if op in OPS else 9)


# ----------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------
def _f(x, nd=3):
    if not _num(x):
        return "—"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.{nd}f}"


def _x(x):
    return "—" if not _num(x) else f"{x:.2f}×"


def acc_cell(r) -> str:
    a = r.get("accuracy")
    if r.get("nonfinite"):
        return f"**FAIL** (NaN/inf at the full shape: {', '.join(r['nonfinite'])})"
    if not a:
        return "not checked"
    st = a.get("status")
    if st == "pass":
        return f"pass ({a['worst_name']} {a['worst_ratio']:.1e} ≤ {a['worst_tol']:.0e})"
    if st == "FAIL":
        return f"**FAIL** ({', '.join(a.get('failed', []))})"
    return f"{st}: {a.get('reason', '')}"[:80]


def stamp_lines(meta: dict, runs: dict | None = None) -> list[str]:
    v = meta.get("versions", {})
    lines = [f"* date: {meta.get('date', '?')}; GPU: {meta.get('gpu', '?')}; driver: {meta.get('driver', '?')}",
             "* versions: " + ", ".join(f"{k} {v[k]}" for k in sorted(v)),
             f"* command: `{meta.get('command', '?')}`"]
    c = meta.get("ceilings")
    if c:
        lines.append(f"* measured ceilings (this run): bf16 matmul {c['matmul_tflops']:.3g} TFLOP/s, "
                     f"copy {c['copy_tbps']:.3g} TB/s")
    if meta.get("merged_from"):
        lines.append("* merged from: " + "; ".join(f"`{m}`" for m in meta["merged_from"]))
    from benchmarks.impls import JAX_FWDBWD_BEFORE

    if not runs or len(runs) == 1:
        lines.append(f"* JAX fwd+bwd timed as: {meta.get('jax_fwdbwd', JAX_FWDBWD_BEFORE)}")
    else:
        for rid, m in runs.items():
            triton = f"triton {m['triton']}; " if m.get("triton") else ""
            how = m.get("jax_fwdbwd", JAX_FWDBWD_BEFORE)
            lines.append(f"  * run {rid}: {m.get('date', '?')} ({triton}JAX fwd+bwd: {how}) "
                         f"`{m.get('command', '?')}`")
    return lines


NOISY_IQR = 1.25  # upper ÷ lower quartile of a row's fwd+bwd samples above which it is marked


def noisy(r) -> bool:
    """Whether the fwd+bwd samples of row ``r`` spread wider than NOISY_IQR (the GPU was shared or
    its clock moved during the timing rounds): its median is suspect."""
    q = (r.get("spread_ms") or {}).get("fwdbwd")
    return bool(q) and _num(q[0]) and q[0] > 0 and q[1] / q[0] > NOISY_IQR


NOTES = [
    f"≈ after a time: its fwd+bwd samples' upper quartile is more than {NOISY_IQR}× the lower one "
    "(the GPU was busy with something else during its timing rounds, e.g. another process's "
    "set-up in run h200-4): the median, and ratios built on it, are suspect.",
    "Times: medians over interleaved rounds, ms (a JAX sample: the mean of back-to-back calls "
    "filling ~20 ms — 3 ms up to run h200-4; torch: do_bench). bwd = (fwd+bwd) − fwd. Inputs bf16 q/k/v (q, k "
    "L2-normalised), fp32 gates, no initial state, chunk 64.",
    "× FLA-graph / × jla: time ÷ the same run's FLA-under-CUDA-graph / jla Mosaic GPU time at the "
    "same shape (>1 = slower).",
    "time/floor: time as % of the roofline floor max(matmul FLOPs ÷ bf16 rate, min bytes ÷ copy "
    "bandwidth), both measured in the same run (benchmarks/roofline.py has the formulas).",
    "peak: device memory of one fwd+bwd beyond its inputs (JAX: XLA's temp + output buffers of the "
    "compiled step; PyTorch: max_memory_allocated growth).",
    "accuracy: every output and gradient vs the float64 token recurrence (ratio ‖x−ref‖/‖ref‖, "
    "rewy-math §8 bf16 thresholds) on a reduced shape with the same (H, D): B=1, T=512 "
    "(computed on the CPU in float64); worst ratio shown. Our implementations' output and "
    "gradients at the full timed shape are also checked finite (a NaN/inf there is a FAIL).",
]


def markdown(result: dict) -> str:
    rows = add_derived(list(result["rows"]))
    out = ["# rewy-jax benchmark results", ""] + stamp_lines(result.get("meta", {}), result.get("runs"))
    out += ["", "## Headline (fwd+bwd ms; fwd in brackets)", ""]
    out += headline(rows)
    out += ["", "## All rows", ""]
    groups = {}
    for r in rows:
        groups.setdefault((r["shape"], r["op"]), []).append(r)
    for (shape, op), grp in sorted(groups.items(), key=lambda kv: _group_order(kv[0])):
        fl = next((r.get("floor") for r in grp if r.get("floor")), None)
        head = f"### {OP_TITLES.get(op, op)} {tuple(int(x) for x in shape.split('x'))}"
        if fl:
            head += (f" — floor fwd {_f(fl['fwd']['ms'], 4)} ms ({fl['fwd']['bound']}), "
                     f"fwd+bwd {_f(fl['fwdbwd']['ms'], 4)} ms ({fl['fwdbwd']['bound']})")
        out += [head, "",
                "| impl | fwd | bwd | fwd+bwd | peak MiB | time/floor (f+b) | × FLA-graph (f+b) | × jla (f+b) | × jla (fwd) | accuracy |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in grp:
            if r.get("status") != "ok":
                out.append(f"| {r['impl']} | {r.get('status')}: {r.get('reason', '')[:120]} |  |  |  |  |  |  |  | {acc_cell(r)} |")
                continue
            t = r["ms"]
            mem = r.get("mem_bytes", {}).get("fwdbwd")
            refused = r.get("refused", {})
            fb = (_f(t.get("fwdbwd")) + (" ≈" if noisy(r) else "") if "fwdbwd" not in refused
                  else f"refused ({refused['fwdbwd'][:90]})")
            pf = r.get("pct_of_floor", {}).get("fwdbwd")
            out.append(
                f"| {r['impl']} | {_f(t.get('fwd'))} | {_f(t.get('bwd'))} | {fb} | "
                f"{_f(mem / 2**20, 1) if _num(mem) else '—'} | {(_f(pf, 0) + '%') if _num(pf) else '—'} | "
                f"{_x(r['vs_fla_graph'].get('fwdbwd'))} | {_x(r['vs_jla'].get('fwdbwd'))} | "
                f"{_x(r['vs_jla'].get('fwd'))} | {acc_cell(r)} |")
        out.append("")
    out += ["## Notes", ""] + [f"* {n}" for n in NOTES]
    return "\n".join(out) + "\n"


def best_ours(grp):
    cands = [r for r in grp if r.get("family") == "ours" and r.get("status") == "ok"
             and _num(r.get("ms", {}).get("fwdbwd"))
             and (r.get("accuracy") or {}).get("status") in ("pass", None)
             and not r.get("nonfinite")]
    return min(cands, key=lambda r: r["ms"]["fwdbwd"]) if cands else None


def headline(rows) -> list[str]:
    groups = {}
    for r in rows:
        groups.setdefault((r["shape"], r["op"]), []).append(r)
    out = ["| shape (B,T,H,D) | op | ours (best variant) | jla Mosaic GPU | FLA graph | FLA eager | "
           "plain JAX autodiff | ours ÷ jla | ours ÷ FLA-graph | ours accuracy |",
           "|---|---|---|---|---|---|---|---|---|---|"]

    def cell(r):
        if r is None:
            return "—"
        if r.get("status") != "ok":
            return r.get("status", "?")
        t = r["ms"]
        ok_fb = "fwdbwd" not in r.get("refused", {})
        fb = _f(t.get("fwdbwd")) if ok_fb else "bwd refused"
        flag = " ✗" if ((r.get("accuracy") or {}).get("status") == "FAIL" or r.get("nonfinite")) else ""
        return f"{fb}{' ≈' if noisy(r) else ''} ({_f(t.get('fwd'))}){flag}"

    for (shape, op), grp in sorted(groups.items(), key=lambda kv: _group_order(kv[0])):
        by = {r["impl"]: r for r in grp}
        b = best_ours(grp)
        ad = next((r for r in grp if r.get("family") == "autodiff"), None)
        ours = (f"{cell(b)} {b['impl'].replace('ours ', '')}" if b else "—")
        out.append(f"| {tuple(int(x) for x in shape.split('x'))} | {OP_TITLES.get(op, op)} | {ours} | "
                   f"{cell(by.get(JLA))} | {cell(by.get(FLA_GRAPH))} | {cell(by.get('FLA eager'))} | "
                   f"{cell(ad)} | {_x(b['vs_jla'].get('fwdbwd')) if b else '—'} | "
                   f"{_x(b['vs_fla_graph'].get('fwdbwd')) if b else '—'} | {acc_cell(b) if b else '—'} |")
    return out


# ----------------------------------------------------------------------------------------------
# Plot
# ----------------------------------------------------------------------------------------------
def plot(result: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in add_derived(list(result["rows"])) if r.get("status") == "ok"
            and _num(r.get("ms", {}).get("fwdbwd")) and "fwdbwd" not in r.get("refused", {})]
    ops = [op for op in OP_TITLES if any(r["op"] == op for r in rows)] or list(OP_TITLES)
    shapes = []
    for r in rows:
        if r["shape"] not in shapes:
            shapes.append(r["shape"])
    impls = []
    for r in rows:
        if r["impl"] not in impls:
            impls.append(r["impl"])
    fig, axes = plt.subplots(1, len(ops), figsize=(4.5 * len(ops), 4.2), squeeze=False)
    width = 0.8 / max(1, len(impls))
    cmap = plt.get_cmap("tab20")
    for ax, op in zip(axes[0], ops):
        for j, impl in enumerate(impls):
            xs, ys = [], []
            for i, s in enumerate(shapes):
                r = next((r for r in rows if r["op"] == op and r["shape"] == s and r["impl"] == impl), None)
                if r is not None:
                    xs.append(i + (j - (len(impls) - 1) / 2) * width)
                    ys.append(r["ms"]["fwdbwd"])
            if xs:
                ax.bar(xs, ys, width, label=impl, color=cmap(j % 20))
        ax.set_yscale("log")
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels([s.replace("x", ",") for s in shapes], rotation=30, fontsize=7)
        ax.set_title(f"{OP_TITLES.get(op, op)}: fwd+bwd ms (log)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    for ax in axes[0][1:]:
        h, lab = ax.get_legend_handles_labels()
        for hh, ll in zip(h, lab):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    meta = result.get("meta", {})
    fig.legend(handles, labels, loc="lower center", ncol=min(6, max(1, len(labels))), fontsize=7)
    fig.suptitle(f"rewy-jax benchmark — {meta.get('gpu', '?')}, {meta.get('date', '?')}", fontsize=9)
    fig.tight_layout(rect=(0, 0.12, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_all(result: dict, out_dir: Path, stem: str) -> dict:
    """Write <stem>.json, <stem>.md and <stem>.png into out_dir; returns their paths."""
    result = dict(result)
    result["rows"] = add_derived(list(result["rows"]))
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md", "png": out_dir / f"{stem}.png"}
    write_json(paths["json"], result)
    paths["md"].write_text(markdown(result))
    try:
        plot(result, paths["png"])
    except Exception as e:  # noqa: BLE001 - a missing plot must not lose the numbers
        print(f"[report] plot failed: {type(e).__name__}: {e}")
        paths.pop("png")
    return paths


README_MARK = "## Latest headline"


def update_readme(result: dict, readme: Path, source: str):
    """Replace the README's "Latest headline" section with this result's headline and stamp."""
    rows = add_derived(list(result["rows"]))
    text = Path(readme).read_text()
    head = text.split(README_MARK)[0]
    body = [README_MARK, "", f"From `{source}` (full tables there):", ""]
    body += stamp_lines(result.get("meta", {}), result.get("runs")) + [""]
    body += ["fwd+bwd ms (fwd in brackets); ✗ = fails the accuracy check.", ""] + headline(rows)
    body += ["", "Notes:", ""] + [f"* {n}" for n in NOTES]
    Path(readme).write_text(head + "\n".join(body) + "\n")
