"""float64 emulation of the Mosaic GPU forward's bf16 rounding points at the benchmark's DeltaNet inputs.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python tools/mosaic_rounding_emulation.py 8 64 [full]

The inputs of benchmarks/accuracy.py at (1, 512, H, D) (DeltaNet, seed 0); the reference is the
float64 recurrence that tools/mosaic_accuracy_repro.py cached under /tmp, else the exact chunked
form (equal to 1e-15). Each rounding point of pallas_kernels/mosaic_gpu/forward.py (T0 stored,
S read by K S and Q S, W, R in S += Kᵀ R and in P R, the tile P, o) is exact ("x"), rounded
once to bf16 ("b", the kernel) or a bf16 pair ("s"); Ag = T0 ⊙ β is a pair in the kernel, so
modelled exact on the rounded T0. ``full`` adds the one-point-at-a-time table.
"""
import os
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import inputs as binputs  # noqa: E402

T, C = 512, 64


def bf(x):
    """x rounded to bf16 once."""
    return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)).astype(np.float64)


def split(x, n=2):
    """x as an n-term bf16 split (hi + lo + ...)."""
    out, r = np.zeros_like(x), x.copy()
    for _ in range(n):
        h = bf(r)
        out += h
        r = r - h
    return out


def ratio(a, b):
    return np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2))


def mode(x, m):
    """m: "x" exact, "b" bf16 once (the kernel), "s" a bf16 pair."""
    return x if m == "x" else bf(x) if m == "b" else split(x)


def run(q, k, v, beta, scale, T0="b", S="b", W="b", R="b", P="b", O="b", RP=None):
    """o [1, T, H, D] and the final state [1, H, D, D] of the chunked forward with each rounding
    point in its mode; RP: R's mode in P R (default R's, which is then the state update's)."""
    RP = R if RP is None else RP
    H, D = q.shape[0], q.shape[-1]
    outs, states = [], []
    for h in range(H):
        St, o = np.zeros((D, D)), np.zeros((T, D))
        for n in range(T // C):
            sl = slice(n * C, (n + 1) * C)
            Q, Kc, Vc, b = q[h, sl], k[h, sl], v[h, sl], beta[h, sl]
            t0 = np.linalg.inv(np.eye(C) + np.tril(b[:, None] * (Kc @ Kc.T), -1))
            Ag = mode(t0, T0) * b[None, :]  # the kernel's Ag is a pair: exact on the rounded T0
            Sl = mode(St, S)
            Rc = Ag @ mode(Vc - Kc @ Sl, W)
            Pm = mode(np.tril(Q @ Kc.T), P)
            o[sl] = scale * (Q @ Sl + Pm @ mode(Rc, RP))
            St = St + Kc.T @ mode(Rc, R)
        outs.append(mode(o, O))
        states.append(St)
    return np.stack(outs, 1)[None], np.stack(states)[None]


def main():
    H = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    D = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    inp = binputs.accuracy_inputs("deltanet", 1, T, H, D, seed=0)
    q, k, v = (inp[n][0].astype(np.float64).transpose(1, 0, 2) for n in ("q", "k", "v"))
    beta = inp["beta"][0].astype(np.float64).T
    args = (q, k, v, beta, D ** -0.5)
    cache = f"/tmp/mosaic_acc_ref_deltanet_{T}_{H}_{D}.npz"
    o, s = run(*args, "x", "x", "x", "x", "x", "x")
    if os.path.exists(cache):
        ref = np.load(cache)
        ro, rs = ref["o"], ref["final_state"]
        print("exact chunked vs the recurrence:", ratio(o, ro), ratio(s, rs))
    else:
        ro, rs = o, s
    exps = [("R chain split", dict(R="s", RP="b")), ("R split both", dict(R="s")),
            ("T0s + R chain", dict(T0="s", R="s", RP="b")), ("T0s + R both", dict(T0="s", R="s")),
            ("W + R chain", dict(W="s", R="s", RP="b")), ("kernel (all bf16)", {})]
    if len(sys.argv) > 3:
        exact = dict(T0="x", S="x", W="x", R="x", P="x", O="x")
        exps += [(f"{name} split", {name: "s"}) for name in ("T0", "S", "W", "P")]
        exps += [("R split out only", dict(RP="s"))]
        exps += [(f"only {name} bf16", {**exact, name: "b"}) for name in ("T0", "S", "W", "R", "P", "O")]
        exps += [("T0+W split", dict(T0="s", W="s")), ("W+R split", dict(W="s", R="s")),
                 ("S+R split", dict(S="s", R="s"))]
    for name, kw in exps:
        o, s = run(*args, **kw)
        print(f"{name:22s} o {ratio(o, ro):.2e} final {ratio(s, rs):.2e}", flush=True)


if __name__ == "__main__":
    main()
