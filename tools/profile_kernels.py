"""Per-kernel times of the Pallas GPU kernels under config variants (one GPU process).

    python -m tools.profile_kernels [--modes none,scalar,vector] [--variants base,w4,bvs64]
        [--shape 2x4096x16x128] [--out FILE]

Each kernel of the forward and the backward is jitted alone on random bf16 inputs of the anchor
shape and timed as the mean of 20 back-to-back launches (median of 5 such runs), so launch
gaps hide behind the previous kernel; the whole forward and forward+backward of
``api.general_delta`` are timed the same way, and fwd+bwd through the public op (deltanet, gdn
or kda for the three gate modes) — the gap to general_delta is the op's XLA glue. A variant is
a set of ``KernelConfig`` field overrides (``VARIANTS``); each run builds its config from the
defaults and those overrides — nothing is module state. Kernel-work tooling, not the peer
benchmark (benchmarks/).

The host loop's dispatch costs ~0.1 ms a call at the anchor, so kernels faster than that all
read ~0.1 ms here (profile-11: wu 0.101 against ncu's 0.065): compare variants of small kernels
with ``tools/trace_op.py --variants``, which sums device events (profile-21). ``VARIANTS``
serves both.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gpu import api, chunk_backward, chunk_local, config, output, state_passes
from rewy_jax import testing

F32 = jnp.float32

# variants that declare g >= -5 for the vector-gate ops (the centred diagonal blocks)
BOUNDED_VARIANTS = ("centred", "cw4", "noqcent")
_PASSES_FWD = ("fwd", "native", "fused", "fused_w32", "fused_f32")
# name -> KernelConfig field overrides on a call's default (``config.KernelConfig.with_overrides``:
# "warps" / "stages" update their tables). The forms the defaults replaced, and launch settings.
VARIANTS = {
    "base": {},
    "w4": {"warps": dict.fromkeys(("intra", "fwd_pass", "output", "bwd_local", "bwd_pass",
                                   "bwd_dlam", "bwd_leaf"), 4)},
    "w8": {"warps": dict.fromkeys(("intra", "fwd_pass", "output", "bwd_local", "bwd_pass",
                                   "bwd_dlam", "bwd_leaf"), 8)},
    "w2": {"warps": {"intra": 2, "wu": 2, "bwd_local": 2}},
    "w4i": {"warps": {"intra": 4, "wu": 4}},
    "lw4": {"warps": {"bwd_leaf": 4}},
    "qw8": {"warps": {"qk_gram": 8}},
    "cw4": {"warps": {"intra": 4, "bwd_leaf": 4, "qk_gram": 4}},
    "out8": {"warps": {"output": 8}},
    "bl8": {"warps": {"bwd_local": 8}},
    "dl2": {"warps": {"bwd_dlam": 2}},
    "dl8": {"warps": {"bwd_dlam": 8}},
    "fpw8": {"warps": {"fwd_pass": 8}},
    "twinw8": {"warps": {"twin_pass": 8}},
    "bvs64": {"block_v_state": 64},
    "bvs16": {"block_v_state": 16},
    "bv128": {"block_v": 128},
    "bk128": {"block_k": 128},
    "lk32": {"block_k": 32, "warps": {"bwd_leaf": 8}},
    "lk32w4": {"block_k": 32, "warps": {"bwd_leaf": 4}},
    "lk64": {"block_k": 64, "warps": {"bwd_leaf": 8}},
    "st1": {"stages": dict.fromkeys(_PASSES_FWD + ("bwd",), 1)},
    "st2": {"stages": dict.fromkeys(_PASSES_FWD + ("bwd",), 2)},
    "twin3": {"stages": {"twin": 3}},
    "twin1": {"stages": {"twin": 1}},
    "centred": {},  # vector gates: centred diagonal blocks (g ≥ −5 here)
    "noqcent": {"qk_gram_centred": False},
    "nogramqk": {"gram_from_qk": False},  # intra builds its T
    "noshared": {"leaf_shared_decay": False},
    "nojinv": {"joint_diag_inverse": False},
    "unprepared": {"gram_from_qk": False, "leaf_shared_decay": False,
                   "joint_diag_inverse": False},
    "perblock": {"stacked_diag": False},
    "fullre": {"keep_chunk_matrices": False},
    "chunkgrid": {"leaf_rowgrid": False, "qk_gram_rowgrid": False},
    "loopleaf": {"leaf_diag": "loop"},
    "levels": {"intra_diag": "levels", "qk_gram_diag": "levels", "leaf_diag": "levels"},
    "qouter": {"qk_gram_diag": "outer"},
    "noks": {"qk_gram_kslice": 0, "warps": {"qk_gram": 4}},
    "ks32": {"qk_gram_kslice": 32},
    "iks16": {"intra_kslice": 16},
    "ik": {"intra_kslice": 128},
    "fp32bwd": {"backward_low_precision": ()},
    "lps": {"backward_low_precision": ("S0", "dS")},
    "nodt": {"backward_low_precision": tuple(n for n in config.LOW_PRECISION_NAMES if n != "dT")},
    "nonpd": {"backward_native_pass_dots": False},
    "apart": {"twin_pass": False},
    "notiles": {"tiles_first": False},
    "unfused": {"fused_output": False},
    "unfused16": {"fused_output": False, "forward_low_precision": ("S0", "R"),
                  "forward_native_pass_dots": False},
    "fwide0": {"forward_low_precision": ()},
    "fwide": {"forward_low_precision": ("S0", "R")},
    "fwides": {"forward_low_precision": ("S0", "R"), "forward_native_pass_dots": False},
    "perchunkh0": {"one_seq_init": False},
    "endin": {"end_after_loop": False},
    "noezrows": {"row_scaled_ez": False},
    "nopd": {"fwd_predecayed": False},
    "noqrowf": {"qk_gram_row_frames": False},
    "noleafe": {"leaf_e_rows": False},
    "leafev": {"leaf_e_rows": True},  # vector gates too
    "leaftf32": {"leaf_native_decayed": False},
    "leafdecay": {"dlam_decays": False},
    "keyside": {"value_side_decay": False},
    "gaterows": {"gate_on_A": False},
    "narrow16": {"narrow_keys": 0},
}


def variant_overrides(variant):
    """The KernelConfig overrides of ``VARIANTS[variant]``, or of "a+b+…": the named variants
    together (say, a trace's winners for different kernels). Two parts that set one field (or
    one warps / stages entry) differently are an error."""
    out = {}
    for part in variant.split("+"):
        if part not in VARIANTS:
            raise KeyError(f"unknown variant {part!r}; expected one of profile_kernels.VARIANTS")
        for key, value in VARIANTS[part].items():
            if key in ("warps", "stages"):
                table = out.setdefault(key, {})
                for name, n in value.items():
                    if table.get(name, n) != n:
                        raise ValueError(f"variant {variant!r}: {part!r} sets {key}[{name}] = "
                                         f"{n}, another part {table[name]}")
                    table[name] = n
            elif key in out and out[key] != value:
                raise ValueError(f"variant {variant!r}: {part!r} sets {key} = {value!r}, "
                                 f"another part {out[key]!r}")
            else:
                out[key] = value
    return out


def parse_setting(text):
    """"field=value" (tools' and benchmarks' command lines) -> (field, value) typed by the
    KernelConfig field: true/false, an integer, a comma list (a tuple of names; "field=," is
    the empty tuple), or a string; "warps.<kernel>=n" / "stages.<pass>=n" give a table entry
    as ("warps", {kernel: n})."""
    key, sep, v = text.partition("=")
    if not sep:
        raise ValueError(f"a kernel setting is field=value; got {text!r}")
    table, _, entry = key.partition(".")
    if table in ("warps", "stages") and entry:
        return table, {entry: int(v)}
    fields = {f.name: f.type for f in dataclasses.fields(config.KernelConfig)}
    if key not in fields:
        raise ValueError(f"unknown kernel setting {key!r}; expected a KernelConfig field "
                         f"({', '.join(sorted(fields))}) or warps.<kernel> / stages.<pass>")
    kind = fields[key]
    if kind == "bool":
        if v.lower() not in ("true", "false"):
            raise ValueError(f"{key} is a bool: true or false, got {v!r}")
        return key, v.lower() == "true"
    if kind == "int":
        return key, int(v)
    if kind == "tuple":
        return key, tuple(x for x in v.split(",") if x)
    return key, v


def is_bounded(variant):
    """Whether the variant (or a part of "a+b") declares g ≥ −5 for the vector-gate ops."""
    return any(part in BOUNDED_VARIANTS for part in variant.split("+"))


def _bench(f, *args, reps=20, runs=5):
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = None
        for _ in range(reps):
            out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t0) / reps)
    return 1e3 * float(np.median(ts))


def _inputs(mode, B, T, H, D, C=64, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    bf = jnp.bfloat16

    def nrm(key, shape, scale=1.0):
        x = jax.random.normal(key, shape, F32)
        return (scale * x / jnp.linalg.norm(x, axis=-1, keepdims=True)).astype(bf)

    q = nrm(ks[0], (B, T, H, D), D ** -0.5 * D ** 0.5)
    k = nrm(ks[1], (B, T, H, D))
    b = jax.random.uniform(ks[2], (B, T, H, 1), F32, 0.0, 1.0)
    e = api.leaf_product(b, k)
    v = jax.random.normal(ks[3], (B, T, H, D), F32).astype(bf)
    z = api.leaf_product(b, v)
    g = G = None
    if mode != "none":
        gshape = (B, T, H) if mode == "scalar" else (B, T, H, D)
        g = -jax.random.uniform(ks[4], gshape, F32, 0.005, 0.2)
        G = jnp.cumsum(api._chunks(g, C), axis=2).reshape(g.shape)  # as api._cum_gates
    N = T // C
    h0 = jnp.zeros((B, H, 2, D, D), F32).at[:, :, 0].set(
        0.1 * jax.random.normal(ks[5], (B, H, D, D), F32))
    reset = (jnp.arange(N) == 0).astype(jnp.int32)
    end = (jnp.arange(N) == N - 1).astype(jnp.int32)
    seq = jnp.zeros((N,), jnp.int32)
    dO = jax.random.normal(ks[6], (B, T, H, D), F32).astype(bf)
    return q, k, e, z, g, G, h0, reset, end, seq, dO, v, b[..., 0]


def profile(mode, variant, shape, backward="rewy", interpret=False, reps=20, runs=5):
    """({kernel or whole pass: ms}, general_delta's gradients) for one gate mode ("none",
    "scalar", "vector") and variant."""
    return _profile(mode, variant, shape, backward, interpret,
                    lambda f, *a: _bench(f, *a, reps=reps, runs=runs))


def _profile(mode, variant, shape, backward, interpret, _bench):
    B, T, H, D = shape
    q, k, e, z, g, G, h0, reset, end, seq, dO, v, beta = _inputs(mode, B, T, H, D)
    overrides = variant_overrides(variant)
    kcfg = config.default_config(mode, D, D, jnp.bfloat16).with_overrides(overrides)
    cfg = api.Config(64, "recompute", backward, interpret, kcfg, is_bounded(variant),
                     one_seq=True,  # one sequence per row: the metadata of _inputs
                     scale=D ** -0.5)  # applied in-kernel, as the op does (launch.Shape.scaled)
    s = api._shape(cfg, q, z, G, h0)
    it = interpret
    rows = {}
    # the forward's e, z, as the op passes them (api.delta_rule_call): k, v and β's per-row
    # scales under KernelConfig.row_scaled_ez, else the rounded products
    frows = (beta, beta) if kcfg.row_scaled_ez else None
    fe, fz = (k, v) if frows else (e, z)

    P = Tg = None
    if mode == "vector" and kcfg.gram_from_qk:
        f = jax.jit(lambda q, k, e, G: chunk_local.qk_gram(s, q, k, G, e=e, interpret=it,
                                                  e_rows=frows and frows[0]))
        rows["qk_gram"] = _bench(f, q, k, fe, G)  # P and intra's T
        P, Tg = f(q, k, fe, G)
    elif mode == "vector":
        f = jax.jit(lambda q, k, G: chunk_local.qk_gram(s, q, k, G, interpret=it))
        rows["qk_gram"] = _bench(f, q, k, G)
        P = f(q, k, G)
    # the forward's stored dtypes: W, U as intra stores them for the state pass, S0, R as the
    # unfused pass stores them for the output
    fd = api._forward_dtypes(s, q.dtype)
    wu_dt = (fd["W"], fd["U"])
    f = jax.jit(lambda k, e, z, G, Tg: chunk_local.intra(s, k, e, z, G, T=Tg, interpret=it,
                                                dtypes=wu_dt, rows=frows))
    rows["intra"] = _bench(f, k, fe, fz, G, Tg)
    A, W, U = f(k, fe, fz, G, Tg)
    sd = api._stored_dtypes(s, q.dtype)  # the backward's stored dtypes
    # the backward's W, U from the kept A (intra given A: "rewy_wu")
    f = jax.jit(lambda k, e, z, G, A: chunk_local.intra(s, k, e, z, G, A=A, interpret=it,
                                               dtypes=(sd["W"], sd["U"]), rows=frows))
    rows["wu"] = _bench(f, k, fe, fz, G, A)
    Wb, Ub = f(k, fe, fz, G, A)
    f = jax.jit(lambda W, U, k, G, h0: state_passes.fwd_pass(s, W, U, k, G, h0, reset, end, seq,
                                                   interpret=it, dtypes=(fd["S0"], fd["R"]),
                                                   forward=True))
    rows["fwd_pass"] = _bench(f, W, U, k, G, h0)
    S0, R, fin = f(W, U, k, G, h0)
    f = jax.jit(lambda q, k, G, S0, R, P: output.output(s, q, k, G, S0, R, P, jnp.bfloat16,
                                                    interpret=it))
    rows["output"] = _bench(f, q, k, G, S0, R, P)
    if kcfg.fused_output:  # the forward's pass with the output inside
        f = jax.jit(lambda W, U, k, G, h0, q, P: state_passes.fwd_pass(
            s, W, U, k, G, h0, reset, end, seq, interpret=it, out=(q, P, jnp.bfloat16),
            forward=True))
        rows["fwd_pass_fused"] = _bench(f, W, U, k, G, h0, q, P)
    if set(sd.values()) != {F32}:  # the backward's own state pass reads and stores those
        f = jax.jit(lambda W, U, k, G, h0: state_passes.fwd_pass(s, W, U, k, G, h0, reset, end, seq,
                                                       interpret=it, dtypes=(sd["S0"], sd["R"])))
        rows["fwd_pass_bwd"] = _bench(f, Wb, Ub, k, G, h0)
        S0, R, _ = f(Wb, Ub, k, G, h0)
        W = Wb
    P = P if mode == "vector" else None  # the recompute backward keeps only vector gates' P
    f = jax.jit(lambda q, k, G, P, dO: output.bwd_local(s, q, k, G, P, dO, interpret=it,
                                                     dtype=sd["dRl"]))
    rows["bwd_local"] = _bench(f, q, k, G, P, dO)
    dRl = f(q, k, G, P, dO)
    dfin = jnp.zeros_like(fin)
    if kcfg.twin_pass:  # bwd_pass and the recompute, one launch
        f = jax.jit(lambda W, U, k, G, h0, q, dO, dRl, dfin: state_passes.twin_pass(
            s, (W, U, k, G, h0, reset, end, seq), (q, k, G, W, dO, dRl, dfin, reset, end, seq),
            interpret=it, fwd_dtypes=(sd["S0"], sd["R"]), bwd_dtypes=(sd["dS"], sd["dR"])))
        rows["twin_pass"] = _bench(f, W, Ub, k, G, h0, q, dO, dRl, dfin)
    f = jax.jit(lambda q, k, G, W, dO, dRl, dfin: state_passes.bwd_pass(s, q, k, G, W, dO, dRl, dfin, reset,
                                                              end, seq, interpret=it,
                                                              dtypes=(sd["dS"], sd["dR"])))
    rows["bwd_pass"] = _bench(f, q, k, G, W, dO, dRl, dfin)
    dSe, dR, dh0 = f(q, k, G, W, dO, dRl, dfin)
    # the backward's chunk kernels as the op runs them: e formed by the leaf from k and β
    # (KernelConfig.leaf_e_rows) or read as XLA's rounded product
    e_rows = frows is not None and backward != "wy" and s.leaf_e_rows()
    f = jax.jit(lambda A, R, dO, dR, e, z, G, S0: chunk_backward.bwd_dlam(
        s, A, R, dO, dR, e, z, G, S0, backward=backward, interpret=it, lam_dtype=sd["lam"],
        dt_dtype=sd["dT"]))
    rows["bwd_dlam"] = _bench(f, A, R, dO, dR, e, z, G, S0)
    lam, dT, dAqk = f(A, R, dO, dR, e, z, G, S0)
    bf = jnp.bfloat16
    f = jax.jit(lambda q, k, e, G, A, S0, dSe, lam, R, dO, dR, dT, dAqk, es: chunk_backward.bwd_leaf(
        s, q, k, e, G, A, S0, dSe, lam, R, dO, dR, dT, dAqk, backward=backward,
        dtypes=(bf, bf, bf), interpret=it, e_scale=es))
    leaf_e, leaf_es = (None, beta) if e_rows else (e, None)
    rows["bwd_leaf"] = _bench(f, q, k, leaf_e, G, A, S0, dSe, lam, R, dO, dR, dT, dAqk, leaf_es)

    def fwd(q, k, v, beta, g, h0):
        """general_delta as the op calls it (api.delta_rule_call), as a function of the
        op's k, v and β: the gradients are comparable between variants either way."""
        if frows:
            return api.general_delta(cfg, q, k, None, v, g, h0, reset, end, seq,
                                     (beta, beta))[0]
        return api.general_delta(cfg, q, k, api.leaf_product(beta, k), api.leaf_product(beta, v),
                                 g, h0, reset, end, seq)[0]

    def loss(q, k, v, beta, g, h0):
        return jnp.sum(fwd(q, k, v, beta, g, h0).astype(F32) * dO.astype(F32))

    argn = (0, 1, 2, 3, 5) if g is None else (0, 1, 2, 3, 4, 5)
    rows["FWD (general_delta)"] = _bench(jax.jit(fwd), q, k, v, beta, g, h0)
    vg = jax.jit(jax.value_and_grad(loss, argnums=argn))
    rows["FWD+BWD (general_delta)"] = _bench(vg, q, k, v, beta, g, h0)
    grads = vg(q, k, v, beta, g, h0)[1]
    grads = (*grads[:-1], grads[-1][:, :, :1])  # dh0 without the padding slot (never written)
    # The same through the public op (rewy_jax), as the benchmark calls it: the difference is
    # the op's XLA glue (the gate cumsum and its VJP, dg's and dβ's last sums, layout).
    op = {"none": "deltanet", "scalar": "gdn", "vector": "kda"}[mode]
    inp = testing.make_inputs(op, B, T, H, D, D, dtype=jnp.bfloat16, initial_state=False)
    kw = dict(backend="pallas_gpu", interpret=interpret, backward=backward,
              kernel_config=overrides)
    if cfg.centred and mode == "vector":  # the bound is a vector-gate option
        kw["gate_lower_bound"] = -5.0

    def op_loss(x):
        return jnp.sum(testing.run_op(op, x, **kw)[0].astype(F32) * dO.astype(F32))

    rows[f"OP_FWD+BWD ({op})"] = _bench(jax.jit(jax.value_and_grad(op_loss)), inp)
    return rows, grads


def grad_gap(grads, ref):
    """Worst ‖x − y‖ / ‖y‖ over the gradients of two variants (same inputs): a variant that
    only reorganises work should agree with the base one to rounding."""
    gap = 0.0
    for x, y in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if not np.all(np.isfinite(x)):
            return float("inf")
        gap = max(gap, float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)))
    return gap


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="none,scalar,vector")
    ap.add_argument("--variants", default="base")
    ap.add_argument("--shape", default="2x4096x16x128")
    ap.add_argument("--backward", default="rewy")
    ap.add_argument("--out", default=None)
    ap.add_argument("--interpret", action="store_true", help="CPU smoke test of this script")
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.shape.split("x"))
    print(jax.devices(), jax.__version__, flush=True)
    table = {}
    for mode in a.modes.split(","):
        first = None  # the mode's first variant's gradients: the others are compared to them
        for var in a.variants.split(","):
            t0 = time.perf_counter()
            try:
                table[mode, var], grads = profile(mode, var, shape, a.backward, a.interpret)
            except Exception as ex:  # noqa: BLE001 — one failing variant must not hide the rest
                print(f"{mode} {var} ERROR {type(ex).__name__}: {str(ex)[:400]}", flush=True)
                continue
            if first is None:
                first = grads
            else:
                table[mode, var]["grad_gap"] = grad_gap(grads, first)
            print(f"{mode} {var} ({time.perf_counter() - t0:.0f}s incl. compile): " +
                  ", ".join(f"{k} {v:.3g}" for k, v in table[mode, var].items()), flush=True)
    lines = [f"per-kernel ms, shape {a.shape} bf16, backward={a.backward}, jax {jax.__version__}"]
    for (mode, var), rows in table.items():
        lines.append(f"{mode:6s} {var:6s} " + " ".join(f"{k.split(' ')[0]}={v:.3g}"
                                                       for k, v in rows.items()))
    print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
