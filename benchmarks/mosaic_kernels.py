"""The Mosaic GPU backend's kernels on a Hopper GPU, beside jla's Mosaic GPU op, in one process.

    python -m benchmarks.mosaic_kernels [--shapes anchor|fla|all] [--impls A,B] [--out FILE.json]

1. Accuracy on the GPU: our Mosaic forward (and jla's, on the same inputs) against a float64
   token recurrence (numpy) at a small shape, per op, as rewy-math §8 ratios.
2. Timing (ms): forward and forward + backward (o and its VJP) of ours (Mosaic; "ours mosaic wy":
   the same kernels with the seven-product per-chunk gradients, backward="wy", the ablation of
   ReWY), jla mosaic_gpu and ours (Pallas-Triton) at the benchmark shapes; host-timed loops of 20
   calls after warm-up, median of 7 loops. Ratios are within this run only.
3. ``--parts``: each stage of our Mosaic pipeline alone at the anchor shape (where the time goes;
   the per-chunk gradient kernel with the ReWY and with the seven-product body).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.shapes import ANCHOR_SHAPE, FLA_SHAPES, Shape

OPS = ("deltanet", "gdn")


def recurrence64(q, k, v, g, beta, scale):
    """float64 token recurrence of DeltaNet/GDN, numpy: (o [B,T,H,V], final [B,H,K,V])."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = np.zeros((B, H, K, V))
    o = np.zeros((B, T, H, V))
    for t in range(T):
        a = np.exp(g[:, t]) if g is not None else np.ones((B, H))
        kt, vt, bt = k[:, t], v[:, t], beta[:, t]
        S = S * a[..., None, None]
        pred = np.einsum("bhk,bhkv->bhv", kt, S)
        S = S + np.einsum("bhk,bhv->bhkv", kt, bt[..., None] * (vt - pred))
        o[:, t] = scale * np.einsum("bhk,bhkv->bhv", q[:, t], S)
    return o, S


def make(op, s: Shape, seed=0):
    rng = np.random.default_rng(seed)
    B, T, H, D = s
    nrm = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = nrm(rng.standard_normal((B, T, H, D)))
    k = nrm(rng.standard_normal((B, T, H, D)))
    v = rng.standard_normal((B, T, H, D))
    beta = rng.uniform(0, 1, (B, T, H))
    g = np.log(rng.uniform(0.9, 1.0, (B, T, H))) if op == "gdn" else None
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    return dict(q=bf(q), k=bf(k), v=bf(v), beta=jnp.asarray(beta, jnp.float32),
                g=None if g is None else jnp.asarray(g, jnp.float32))


def ours(op, x, scale, backend="mosaic_gpu", policy="recompute", backward="rewy"):
    """Our public op on one backend (the wrapper and its XLA glue included in the timing)."""
    import rewy_jax

    def f(q, k, v, g, b):
        kw = dict(scale=scale, output_final_state=True, backend=backend, policy=policy,
                  backward=backward)
        if op == "gdn":
            return rewy_jax.chunk_gated_delta_rule(q, k, v, g, b, **kw)
        return rewy_jax.chunk_delta_rule(q, k, v, b, **kw)
    return f, (x["q"], x["k"], x["v"], x["g"], x["beta"])


def jla_mosaic(op, x, scale):
    from jla.ops import linear_attention

    kind = {"deltanet": "deltanet", "gdn": "gated_deltanet"}[op]

    def f(q, k, v, g, b):
        gates = dict(beta=b.astype(jnp.bfloat16))
        if op == "gdn":
            gates["g"] = g
        return linear_attention(kind, q, k, v, impl="mosaic_gpu", scale=scale, output_final_state=True,
                                **gates)
    return f, (x["q"], x["k"], x["v"], x["g"], x["beta"])


def phase(f, args, ph):
    """A no-argument callable running ``f`` (fwd) or ``f`` and its VJP for random cotangents."""
    if ph == "fwd":
        jf = jax.jit(f)
        return lambda: jf(*args)

    def fb(*a):
        (o, s), vjp = jax.vjp(f, *a)
        return vjp((jnp.ones_like(o) * 0.01, jnp.zeros_like(s)))
    jfb = jax.jit(fb)
    return lambda: jfb(*args)


def parts(op, s: Shape):
    """Each stage of our Mosaic pipeline alone (ms)."""
    from pallas_kernels.mosaic_gpu import api, config
    from pallas_kernels.mosaic_gpu.chunk_backward import chunk_backward
    from pallas_kernels.mosaic_gpu.chunk_inverse import chunk_inverse
    from pallas_kernels.mosaic_gpu.forward import fused_forward
    from pallas_kernels.mosaic_gpu.state_backward import state_backward

    x = make(op, s)
    scale = s.D ** -0.5
    cfg = config.default_config(s.D, s.D, 2, heads=s.B * s.H, gated=op == "gdn")
    qp, kp, vp, t0, g2, bh = jax.jit(api.prepare)(x["q"], x["k"], x["v"], x["g"], x["beta"])
    out = {}
    out["prepare (with T0)"] = time_ms(lambda: jax.jit(api.prepare)(x["q"], x["k"], x["v"], x["g"], x["beta"]))
    out["  of which T0 (kernel)"] = time_ms(lambda: jax.jit(chunk_inverse)(kp, bh))
    ff = jax.jit(lambda *a: fused_forward(*a, None, scale=scale, cfg=cfg.forward, out_final=True,
                                          save_states=False))
    out["fused forward"] = time_ms(lambda: ff(qp, kp, vp, t0, g2, bh))
    ffs = jax.jit(lambda *a: fused_forward(*a, None, scale=scale, cfg=cfg.forward, out_final=True,
                                           save_states=True))
    o, _, states = ffs(qp, kp, vp, t0, g2, bh)
    out["fused forward + states"] = time_ms(lambda: ffs(qp, kp, vp, t0, g2, bh))
    rec = jax.jit(lambda *a: fused_forward(*a, None, scale=scale, cfg=cfg.forward, out_final=False,
                                           save_states=True, out_o=False))
    out["state recompute (no output)"] = time_ms(lambda: rec(qp, kp, vp, t0, g2, bh))
    # the forward's other layouts (default_config picks by grid size): A/B in one process
    # (with the default's split_r), and the default with split_r flipped (R as a bf16 pair or not)
    split = cfg.forward.split_r
    for name, fc in (("value rows, 64 columns", config.default_config(s.D, s.D, 2, gated=op == "gdn").forward),
                     ("key rows, 32 columns, 2 stages",
                      config.PassConfig(block_v=32, stages=2, key_rows=True, split_r=split)),
                     (f"split_r={not split}", dataclasses.replace(cfg.forward, split_r=not split))):
        if fc != cfg.forward:
            alt = jax.jit(lambda *a, fc=fc: fused_forward(*a, None, scale=scale, cfg=fc, out_final=True,
                                                          save_states=False))
            out[f"fused forward ({name})"] = time_ms(lambda: alt(qp, kp, vp, t0, g2, bh))
    sb = jax.jit(lambda *a: state_backward(*a, None, scale=scale, cfg=cfg.state_backward))
    lam, dst, _ = sb(qp, kp, o, t0, g2, bh)
    out["state backward"] = time_ms(lambda: sb(qp, kp, o, t0, g2, bh))
    cb = jax.jit(lambda *a: chunk_backward(*a, scale=scale, cfg=cfg.chunk_backward))
    out["chunk backward"] = time_ms(lambda: cb(qp, kp, vp, o, lam, states, dst, t0, g2, bh))
    # the seven-product body (backward="wy") on the same operands: the ReWY ablation's kernel
    wy_cfg = config.default_config(s.D, s.D, 2, backward="wy", heads=s.B * s.H).chunk_backward
    cbw = jax.jit(lambda *a: chunk_backward(*a, scale=scale, cfg=wy_cfg))
    out["chunk backward wy"] = time_ms(lambda: cbw(qp, kp, vp, o, lam, states, dst, t0, g2, bh))
    if s.D <= 128:  # the two-warpgroup split of the whole-width kernel (A/B in one process)
        n_wg = 3 - cfg.chunk_backward.warpgroups  # the count the default does not take
        cfg2 = config.ChunkBackwardConfig(warpgroups=n_wg)
        cb2 = jax.jit(lambda *a: chunk_backward(*a, scale=scale, cfg=cfg2))
        out[f"chunk backward ({n_wg} WGs)"] = time_ms(lambda: cb2(qp, kp, vp, o, lam, states, dst, t0, g2, bh))
        # the same outputs on the GPU (in the interpreter they agree to fp32 reassociation):
        # rms of the difference over the rms of the default kernel's output (over 1 if 0)
        one, two = (f(qp, kp, vp, o, lam, states, dst, t0, g2, bh) for f in (cb, cb2))
        names = ("dq", "dk", "dv", "dbeta", "dG", "u", "sds")
        rms = lambda x: float(jnp.sqrt(jnp.mean(jnp.asarray(x, jnp.float32) ** 2)))  # noqa: E731
        print(dict(kind="check", op=op, part=f"chunk backward: {n_wg} WGs vs the default",
                   **{n: rms(jnp.asarray(b, jnp.float32) - jnp.asarray(a, jnp.float32)) / (rms(a) or 1.0)
                      for n, a, b in zip(names, one, two)}), flush=True)
    return out


def vector_parts(op, s: Shape, bound=None, resets=False, interpret=None):
    """Each stage of our Mosaic KDA/GDN2 pipeline alone (ms). Gates in [−1, 0]; ``bound``: a
    declared gate lower bound (the centred frames when it permits them); ``resets``: 1% of the
    gates −inf besides (every chunk takes the exact frames). ``interpret``: GPU interpreter
    params (the CPU smoke test of this function)."""
    from pallas_kernels.mosaic_gpu import vector_api as va
    from pallas_kernels.mosaic_gpu.vector_chunk import vector_chunk
    from pallas_kernels.mosaic_gpu.vector_chunk_backward import vector_chunk_backward
    from pallas_kernels.mosaic_gpu.vector_forward import vector_state_output
    from pallas_kernels.mosaic_gpu.prep import pad_time
    from pallas_kernels.mosaic_gpu.vector_prep import prepare_vector
    from pallas_kernels.mosaic_gpu.vector_state_backward import vector_state_backward

    B, T, H, D = s
    rng = np.random.default_rng(0)
    nrm = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    q, k = (bf(nrm(rng.standard_normal((B, T, H, D)))) for _ in range(2))
    v = bf(rng.standard_normal((B, T, H, D)))
    lo = -1.0 if bound is None else bound / 5
    g = rng.uniform(lo, 0.0, (B, T, H, D))
    if resets:
        g[rng.uniform(size=g.shape) < 0.01] = -np.inf
    g = jnp.asarray(g, jnp.float32)
    kda = op == "kda"
    b = jnp.asarray(rng.uniform(0, 1, (B, T, H) if kda else (B, T, H, D)), jnp.float32)
    w = None if kda else jnp.asarray(rng.uniform(0, 1, (B, T, H, D)), jnp.float32)
    cfg = va.default_config(D, D, bound, op=op)
    scale = D ** -0.5
    pre = jax.jit(lambda q, k, v, g, b, w: prepare_vector(
        q, k, v, g, beta=b if kda else None, b=None if kda else b, w=w, gate_lower_bound=bound,
        interpret=bool(interpret)))
    prep = pre(q, k, v, g, b, w)
    Tp = prep[1].shape[1]
    timer = time_ms if interpret is None else run_once  # the interpreter: the smoke test
    out = {"prepare (XLA)": timer(lambda: pre(q, k, v, g, b, w))}
    ch = jax.jit(lambda *a: vector_chunk(*a, scale=scale, centred=cfg.centred, out_inverse=True,
                                          interpret=interpret))
    chunk = ch(*prep)
    out["vector chunk (+ inverse pair)"] = timer(lambda: ch(*prep))
    ch0 = jax.jit(lambda *a: vector_chunk(*a, scale=scale, centred=cfg.centred, interpret=interpret))
    out["vector chunk (forward only)"] = timer(lambda: ch0(*prep))
    so = jax.jit(lambda *a: vector_state_output(*a, None, cfg=cfg, out_final=True,
                                                        interpret=interpret))
    out["state + output"] = timer(lambda: so(*chunk[:5], prep[3]))
    sos = jax.jit(lambda *a: vector_state_output(*a, None, cfg=cfg, out_final=False,
                                                         save_states=True, interpret=interpret))
    o, _, states, r = sos(*chunk[:5], prep[3])
    out["state + output + states, R"] = timer(lambda: sos(*chunk[:5], prep[3]))
    do = (o * 0.01).astype(o.dtype)
    sb = jax.jit(lambda *a: vector_state_backward(*a, None, cfg=cfg.state_backward,
                                                          interpret=interpret))
    qp, kp, _, g2, erase, flags = prep
    w_, _, qg, kt, p, a_hi, a_lo = chunk
    dr, dstates, _ = sb(kt, w_, qg, p, do, g2)
    out["state backward"] = timer(lambda: sb(kt, w_, qg, p, do, g2))
    e = jax.jit(va._erase_tokens)(erase, kp)
    # the leaf maps the op runs in the kernel
    leaf = dict(kda_leaf=(erase, prep[2])) if kda else dict(gdn2_leaf=(erase, pad_time(w, Tp), pad_time(v, Tp)))
    cb = jax.jit(lambda *a: vector_chunk_backward(*a, scale=scale, centred=cfg.centred, interpret=interpret,
                                                  load_sets=cfg.grad_load_sets, **leaf))
    args = (qp, kp, e, g2, do, dr, r, states, dstates, a_hi, a_lo, flags)
    out["chunk backward"] = timer(lambda: cb(*args))
    return out


IMPLS = {"ours mosaic": ours,
         "ours mosaic wy": lambda op, x, scale: ours(op, x, scale, backward="wy"),
         "ours mosaic save": lambda op, x, scale: ours(op, x, scale, policy="save"),
         "jla mosaic": jla_mosaic,
         "ours triton": lambda op, x, scale: ours(op, x, scale, backend="pallas_gpu")}


def run_once(fn):
    """Runs ``fn`` once and reports 0 ms: the CPU smoke tests' stand-in for :func:`time_ms`."""
    jax.block_until_ready(fn())
    return 0.0


def time_ms(fn, loops=20, reps=7):
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(loops):
            r = fn()
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t) / loops * 1e3)
    return statistics.median(out)


def ratio(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.sqrt(np.mean((x - ref) ** 2)) / np.sqrt(np.mean(ref ** 2)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="all", choices=("anchor", "fla", "all"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--parts", action="store_true")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--vector-parts", action="store_true",
                    help="only the KDA/GDN2 kernels alone at the anchor (gates in [-1, 0] undeclared, "
                         "the same with 1%% resets, and declared g >= -5)")
    ap.add_argument("--impls", default=",".join(IMPLS),
                    help=f"comma list of implementations to time (default: all of {', '.join(IMPLS)})")
    a = ap.parse_args()
    impls = {n: IMPLS[n] for n in a.impls.split(",")}
    rows = []
    print("jax", jax.__version__, jax.devices()[0].device_kind, flush=True)
    if a.vector_parts:
        for op in ("kda", "gdn2"):
            for bound, resets, tag in ((None, False, ""), (None, True, " resets"), (-5.0, False, " g>=-5")):
                for name, ms in vector_parts(op, ANCHOR_SHAPE, bound, resets).items():
                    rows.append(dict(kind="part_ms", op=op + tag, shape=ANCHOR_SHAPE.label(), part=name, ms=ms))
                    print(rows[-1], flush=True)
        a.skip_accuracy, a.shapes, impls = True, "anchor", {}
    if a.parts:
        for op in OPS:
            for name, ms in parts(op, ANCHOR_SHAPE).items():
                rows.append(dict(kind="part_ms", op=op, shape=ANCHOR_SHAPE.label(), part=name, ms=ms))
                print(rows[-1], flush=True)
    acc = Shape(1, 300, 4, 128)
    for op in OPS if not a.skip_accuracy else ():
        x = make(op, acc, seed=1)
        scale = acc.D ** -0.5
        f64 = {n: (None if x[n] is None else np.asarray(x[n], np.float64)) for n in x}
        ro, rs = recurrence64(f64["q"], f64["k"], f64["v"], f64["g"], f64["beta"], scale)
        for name, mk in IMPLS.items():
            try:
                f, args = mk(op, x, scale)
                o, s = jax.jit(f)(*args)
                rows.append(dict(kind="accuracy", op=op, impl=name, o=ratio(o.astype(jnp.float32), ro),
                                 final=ratio(s, rs)))
            except Exception as e:  # noqa: BLE001 - report and go on
                rows.append(dict(kind="accuracy", op=op, impl=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
            print(rows[-1], flush=True)
    shapes = {"anchor": [ANCHOR_SHAPE], "fla": FLA_SHAPES, "all": [ANCHOR_SHAPE] + FLA_SHAPES}[a.shapes]
    for s in shapes:
        if s.D not in (64, 128):
            continue
        for op in OPS:
            x = make(op, s)
            for name, mk in impls.items():
                for ph in ("fwd", "fwdbwd"):
                    try:
                        ms = time_ms(phase(*mk(op, x, s.D ** -0.5), ph))
                        rows.append(dict(kind=ph, op=op, shape=s.label(), impl=name, ms=ms))
                    except Exception as e:  # noqa: BLE001
                        rows.append(dict(kind=ph, op=op, shape=s.label(), impl=name,
                                         error=f"{type(e).__name__}: {str(e)[:300]}"))
                    print(rows[-1], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print("\n| op | part (anchor) | ms |\n|---|---|---|")
    for r in rows:
        if r["kind"] == "part_ms":
            print(f"| {r['op']} | {r['part']} | {fmt(r['ms'])} |")
    # wy/rewy: the seven-product backward against ReWY, same kernels and policy (recompute)
    print("\n| op | shape | phase | ours mosaic | ours mosaic wy | ours mosaic save | jla mosaic | "
          "ours triton | ours/jla | wy/rewy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    t = {(r["kind"], r["op"], r["shape"], r["impl"]): r.get("ms") for r in rows
         if r["kind"] in ("fwd", "fwdbwd")}
    for (ph, op, shp) in dict.fromkeys((r["kind"], r["op"], r["shape"]) for r in rows
                                       if r["kind"] in ("fwd", "fwdbwd")):
        m, mw, ms, j, tr = (t.get((ph, op, shp, n)) for n in (
            "ours mosaic", "ours mosaic wy", "ours mosaic save", "jla mosaic", "ours triton"))
        best = min(x for x in (m, ms) if x) if (m or ms) else None
        print(f"| {op} | {shp} | {ph} | {fmt(m)} | {fmt(mw)} | {fmt(ms)} | {fmt(j)} | {fmt(tr)} | "
              f"{fmt(best / j if best and j else None)} | {fmt(mw / m if mw and m else None)} |")


if __name__ == "__main__":
    main()
