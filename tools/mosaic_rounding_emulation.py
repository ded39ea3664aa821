"""float64 emulation of the Mosaic GPU forward's bf16 rounding points at the benchmark's DeltaNet inputs.

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python tools/mosaic_rounding_emulation.py 8 64 [full]

The inputs of benchmarks/accuracy.py at (1, 512, H, D) (DeltaNet, seed 0); the reference is the
float64 recurrence that tools/mosaic_accuracy_repro.py cached under /tmp, else the exact chunked
form (equal to 1e-15). Each rounding point of pallas_kernels/mosaic_gpu/forward.py (T0 stored,
S read by K S and Q S, W, R in S += Kᵀ R and in P R, the tile P, o) is exact ("x"), rounded
once to bf16 ("b", the kernel) or a bf16 pair ("s"); Ag = T0 ⊙ β is a pair in the kernel, so
modelled exact on the rounded T0. ``full`` adds the one-point-at-a-time table.
"""
import sys, itertools
import numpy as np, jax.numpy as jnp
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from benchmarks import inputs as binputs
def bf(x): return np.asarray(jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)).astype(np.float64)
def split(x, n=2):  # n-term bf16 split
    out = np.zeros_like(x); r = x.copy()
    for _ in range(n):
        h = bf(r); out += h; r = r - h
    return out
H = int(sys.argv[1]) if len(sys.argv) > 1 else 8; D = int(sys.argv[2]) if len(sys.argv) > 2 else 64
T = 512; C = 64
inp = binputs.accuracy_inputs("deltanet", 1, T, H, D, seed=0)
import os
fn = f"/tmp/mosaic_acc_ref_deltanet_{T}_{H}_{D}.npz"
ref = np.load(fn) if os.path.exists(fn) else None
q = inp["q"][0].astype(np.float64).transpose(1, 0, 2); k = inp["k"][0].astype(np.float64).transpose(1, 0, 2)
v = inp["v"][0].astype(np.float64).transpose(1, 0, 2); beta = inp["beta"][0].astype(np.float64).T
scale = D ** -0.5
def r_(a, b): return np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2))
def mode(x, m):
    return x if m == "x" else bf(x) if m == "b" else split(x) if m == "s" else split(x, 3)
def run(T0="b", S="b", W="b", R="b", P="b", O="b", RP=None):
    RP = R if RP is None else RP
    os_, ss = [], []
    for h in range(H):
        St = np.zeros((D, D)); o = np.zeros((T, D))
        for n in range(T // C):
            sl = slice(n * C, (n + 1) * C); Q, Kc, Vc, b = q[h, sl], k[h, sl], v[h, sl], beta[h, sl]
            L = np.eye(C) + np.tril(b[:, None] * (Kc @ Kc.T), -1); t0 = np.linalg.inv(L)
            t0 = mode(t0, T0); Ag = t0 * b[None, :]  # Ag split: exact product of rounded T0 and beta
            Sl = mode(St, S)
            Wc = mode(Vc - Kc @ Sl, W)
            Rc = Ag @ Wc
            Rs = mode(Rc, R); Rp = mode(Rc, RP)
            Pm = mode(np.tril(Q @ Kc.T), P)
            o[sl] = scale * (Q @ Sl + Pm @ Rp)
            St = St + Kc.T @ Rs
        os_.append(mode(o, O)); ss.append(St)
    return np.stack(os_, 1)[None], np.stack(ss)[None]
o, s = run("x", "x", "x", "x", "x", "x")
if ref is None: ro, rs = o, s
else:
    ro = ref["o"]; rs = ref["final_state"]; print("exact chunked vs ref:", r_(o, ro), r_(s, rs))
exps = [("R chain split", dict(R="s", RP="b")), ("R split both", dict(R="s")), ("T0s + R chain", dict(T0="s", R="s", RP="b")), ("T0s + R both", dict(T0="s", R="s")),
 ("W + R chain", dict(W="s", R="s", RP="b")), ("kernel (all bf16)", {}),
]
if len(sys.argv) > 3: exps = exps + [("O exact", dict(O="x")), ("T0 exact", dict(T0="x")), ("T0 split", dict(T0="s")),
        ("S split", dict(S="s")), ("W split", dict(W="s")), ("R split (both)", dict(R="s")),
        ("R split chain only", dict(R="s", RP="b")), ("R split out only", dict(RP="s")),
        ("P split", dict(P="s")),
        ("only T0 bf16", dict(S="x", W="x", R="x", P="x", O="x")), ("only S", dict(T0="x", W="x", R="x", P="x", O="x")),
        ("only W", dict(T0="x", S="x", R="x", P="x", O="x")), ("only R", dict(T0="x", S="x", W="x", P="x", O="x")),
        ("only P", dict(T0="x", S="x", W="x", R="x", O="x")), ("only O", dict(T0="x", S="x", W="x", R="x", P="x")),
        ("T0+W split", dict(T0="s", W="s")), ("T0+R split", dict(T0="s", R="s")), ("W+R split", dict(W="s", R="s")),
        ("S+R split", dict(S="s", R="s")), ("S+W split", dict(S="s", W="s")),
        ]
for name, kw in exps:
    o, s = run(**kw); print(f"{name:22s} o {r_(o, ro):.2e} final {r_(s, rs):.2e}", flush=True)
