"""Roofline of the TPU kernels on paper: FLOPs and HBM bytes per chunk, time on TPU v5e / v6e.

The work is *counted from the kernels themselves*: ``kernels.forward_chunk`` and
``kernels.backward_chunk`` (exactly what one grid step computes) are traced to a jaxpr on the
block shapes and every primitive is tallied:

* MXU: ``dot_general`` FLOPs (2·M·N·K), charged in bf16 MXU passes by their precision: fp32
  ``HIGHEST`` 6 (the ``bf16_6x`` emulation, see jax-ml/jax#18934 and ``jax.lax.Precision``),
  ``HIGH`` 3 (``bf16x3``), bf16 operands 1. An "all-bf16" column shows the same FLOPs at one pass.
* EUP: transcendentals (``exp``) — element count.
* VPU: other elementwise/reduction ops — element count (not in the roofline: no published VPU
  peak; listed so the vector-gate pivot sweep's cost is visible).

HBM bytes per chunk come from the BlockSpecs (what the pipeline DMAs per grid step); the
per-sequence state blocks (h0, final, dfinal, dh0: K·V·4 each) are amortised over a sequence and
left out. Peaks (published, per chip): v5e 197 TFLOP/s bf16, 819 GB/s HBM
(https://cloud.google.com/tpu/docs/v5e); v6e 918 TFLOP/s bf16, 1638 GB/s HBM
(https://cloud.google.com/tpu/docs/v6e).

Run: ``python -m tools.tpu_roofline`` (prints the tables), or with ``--markdown`` to
regenerate benchmarks/tpu_roofline.md.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp

from pallas_kernels.tpu import kernels as tk

PEAKS = {  # bf16 FLOP/s, HBM bytes/s
    "v5e": (197e12, 819e9),
    "v6e": (918e12, 1638e9),
}
FP32_PASSES = 6  # Precision.HIGHEST on the MXU
_EUP = {"exp", "exp2", "log", "log1p", "tanh", "logistic", "rsqrt", "sqrt", "pow"}
_FREE = {"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "slice", "concatenate", "iota",
         "transpose", "pjit", "jit", "closed_call", "custom_jvp_call", "custom_vjp_call", "copy",
         "convert_element_type", "dynamic_slice", "gather"}


def _size(aval):
    n = 1
    for d in aval.shape:
        n *= d
    return n


def count_jaxpr(jaxpr, tally=None):
    """Tally MXU FLOPs, EUP and VPU element ops of a (closed) jaxpr, recursing into sub-jaxprs."""
    tally = collections.Counter() if tally is None else tally
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        for p in eqn.params.values():
            sub = getattr(p, "jaxpr", None)
            if sub is not None:
                count_jaxpr(getattr(sub, "jaxpr", sub), tally)
        if name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval
            contract = 1
            for d in lc:
                contract *= lhs.shape[d]
            flops = 2 * _size(eqn.outvars[0].aval) * contract
            prec = eqn.params.get("precision")
            prec = prec[0] if isinstance(prec, tuple) else prec
            if lhs.dtype != jnp.float32 or prec in (None, jax.lax.Precision.DEFAULT):
                passes = 1  # bf16 operands (or DEFAULT: one bf16 pass on TPU)
            elif prec == jax.lax.Precision.HIGH:
                passes = 3  # bf16x3
            else:
                passes = FP32_PASSES  # HIGHEST
            tally["mxu_flops"] += flops
            tally["mxu_fp32_flops"] += flops if passes > 1 else 0
            tally["mxu_pass_flops"] += flops * passes
        elif name in _EUP:
            tally["eup"] += _size(eqn.outvars[0].aval)
        elif name.startswith("reduce_"):
            tally["vpu"] += _size(eqn.invars[0].aval)
        elif name not in _FREE and eqn.outvars:
            tally["vpu"] += _size(eqn.outvars[0].aval)
    return tally


# Per op: (erase b, write w, gate g) kinds as the backend glue passes them.
OP_GATES = {"DeltaNet": ("scalar", None, None), "GDN": ("scalar", None, "scalar"),
            "KDA": ("scalar", None, "vector"), "GDN2": ("vector", "vector", "vector")}


def chunk_work(op, C, K, V, dtype=jnp.bfloat16, operands="auto"):
    """Per-chunk tallies of the kernels of ``op``: forward, states pass, backward (ReWY/WY, R
    recomputed or saved). Returns {kernel: Counter(mxu_flops, mxu_fp32_flops, mxu_pass_flops,
    eup, vpu, hbm_bytes)}."""
    S = jax.ShapeDtypeStruct
    f32 = jnp.float32
    if operands == "auto":  # as the backend glue: bf16 operands for bf16/fp16 callers
        operands = "bfloat16" if jnp.dtype(dtype).itemsize < 4 else None
    it = jnp.dtype(dtype).itemsize

    def token(kind, D):
        return {None: None, "scalar": S((1, C), f32), "vector": S((C, D), f32)}[kind]

    def token_bytes(kind, D):  # scalars: one (8, C) f32 tile per 8 chunks, lanes padded to 128
        return {None: 0, "scalar": 4 * max(C, 128), "vector": 4 * C * D}[kind]

    kb, kw, kg = OP_GATES[op]
    b, w, g = token(kb, K), token(kw, V), token(kg, K)
    x, xv = S((C, K), dtype), S((C, V), dtype)
    S0, R, dO, dS = S((K, V), f32), S((C, V), f32), S((C, V), dtype), S((K, V), f32)

    def trace(fn, *args):
        return count_jaxpr(jax.make_jaxpr(fn)(*args).jaxpr)

    # HBM per grid step (the BlockSpecs): q, k, v in the input dtype, the gates fp32.
    gates = token_bytes(kb, K) + token_bytes(kw, V) + token_bytes(kg, K)
    inputs = 2 * C * K * it + C * V * it + gates
    out = {}
    fwd = lambda q, k, v, b, w, g, S0: tk.forward_chunk(q, k, v, b, w, g, S0, operands)  # noqa: E731
    out["forward"] = trace(fwd, x, x, xv, b, w, g, S0)
    out["forward"]["hbm_bytes"] = inputs + C * V * it
    out["forward (save S0, R)"] = collections.Counter(out["forward"])
    out["forward (save S0, R)"]["hbm_bytes"] += K * V * 4 + C * V * 4
    out["states pass"] = collections.Counter(out["forward"])
    out["states pass"]["hbm_bytes"] = inputs + K * V * 4
    grads_bytes = inputs  # dq, dk, dv, db, dw, dg mirror the inputs
    for scheme in ("rewy", "wy"):
        for saved in (False, True):
            fn = lambda q, k, v, b, w, g, S0, R, dO, dS, scheme=scheme: tk.backward_chunk(  # noqa: E731
                q, k, v, b, w, g, S0, R, dO, dS, scheme, operands)
            tally = trace(fn, x, x, xv, b, w, g, S0, R if saved else None, dO, dS)
            tally["hbm_bytes"] = (inputs + K * V * 4 + C * V * it + (C * V * 4 if saved else 0)
                                  + grads_bytes)
            out[f"backward {scheme}" + (" (saved R)" if saved else "")] = tally
    return out


def roofline_us(t, chip):
    """(MXU µs as implemented: fp32 products at 6 bf16 passes, MXU µs if every product took
    bf16 operands, HBM µs) for one chunk of one head."""
    flops, bw = PEAKS[chip]
    return (t["mxu_pass_flops"] / flops * 1e6, t["mxu_flops"] / flops * 1e6,
            t["hbm_bytes"] / bw * 1e6)


OPS = list(OP_GATES)


def tables(C=64, dims=(64, 128, 256), dtype=jnp.bfloat16) -> str:
    lines = []
    for D in dims:
        lines.append(f"\n#### K = V = {D}, C = {C}, {jnp.dtype(dtype).name} inputs "
                     "(per chunk of one head)\n")
        lines.append("| op | kernel | MXU MFLOP (fp32 part) | EUP exp (k) | VPU ops (k) | HBM KiB | "
                     "v5e µs: MXU / all-bf16 MXU / HBM | v6e µs: MXU / all-bf16 MXU / HBM | "
                     "bound v6e |")
        lines.append("|---|---|---:|---:|---:|---:|---|---|---|")
        for op in OPS:
            for name, t in chunk_work(op, C, D, D, dtype).items():
                cells = ["{:.2f} / {:.2f} / {:.2f}".format(*roofline_us(t, chip))
                         for chip in ("v5e", "v6e")]
                mxu, _, mem = roofline_us(t, "v6e")
                lines.append(f"| {op} | {name} | {t['mxu_flops'] / 1e6:.2f} "
                             f"({t['mxu_fp32_flops'] / 1e6:.2f}) | {t['eup'] / 1e3:.0f} | "
                             f"{t['vpu'] / 1e3:.0f} | {t['hbm_bytes'] / 1024:.0f} | {cells[0]} | "
                             f"{cells[1]} | {'MXU' if mxu > mem else 'HBM'} |")
    return "\n".join(lines)


def rewy_vs_wy(C=64, dims=(64, 128, 256)) -> str:
    """Backward kernel (R recomputed) MXU FLOPs, ReWY vs the seven-product WY, plus the MXU time
    as implemented (fp32 products at 6 passes) for fp32 and bf16 callers on v6e."""
    lines = ["| op | K = V | ReWY bwd MFLOP | WY bwd MFLOP | FLOPs saved | ReWY core (Λ, ΛRᵀ, ΛS0ᵀ) "
             "MFLOP | WY core (7 products) MFLOP | v6e MXU µs ReWY / WY, fp32 callers | "
             "v6e MXU µs ReWY / WY, bf16 callers |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for op in OPS:
        for D in dims:
            w = chunk_work(op, C, D, D)
            w32 = chunk_work(op, C, D, D, jnp.float32)
            r, y = w["backward rewy"]["mxu_flops"], w["backward wy"]["mxu_flops"]
            core_r = 2 * C * C * D + 2 * C * C * D + 2 * C * D * D  # AᵀdR, ΛRᵀ, ΛS0ᵀ
            core_w = (2 * C * D * D + 2 * C * C * D * 2 + 2 * C * C * D * 2 + 2 * C * C * C * 2)
            t32 = [roofline_us(w32[k], "v6e")[0] for k in ("backward rewy", "backward wy")]
            t16 = [roofline_us(w[k], "v6e")[0] for k in ("backward rewy", "backward wy")]
            lines.append(f"| {op} | {D} | {r / 1e6:.2f} | {y / 1e6:.2f} | {100 * (y - r) / y:.1f}% | "
                         f"{core_r / 1e6:.2f} | {core_w / 1e6:.2f} | {t32[0]:.3f} / {t32[1]:.3f} | "
                         f"{t16[0]:.3f} / {t16[1]:.3f} |")
    return "\n".join(lines)


def training_step(B=8, H=16, T=4096, D=128, C=64, dtype=jnp.bfloat16) -> str:
    """Roofline of one forward + backward over a batch, per policy, summing max(MXU, HBM) per
    kernel per chunk (no overlap between kernels; VPU/EUP not included)."""
    n = B * H * (-(-T // C))
    lines = [f"B={B}, H={H}, T={T}, K=V={D}, C={C}, {jnp.dtype(dtype).name}: {n} chunk-steps per "
             "kernel.", "", "| op | policy / backward | v5e ms | v6e ms |", "|---|---|---:|---:|"]
    for op in OPS:
        w = chunk_work(op, C, D, D, dtype)
        plans = {"recompute / rewy": ["forward", "states pass", "backward rewy"],
                 "recompute / wy": ["forward", "states pass", "backward wy"],
                 "save / rewy": ["forward (save S0, R)", "backward rewy (saved R)"],
                 "save / wy": ["forward (save S0, R)", "backward wy (saved R)"]}
        for plan, kernels in plans.items():
            ms = []
            for chip in ("v5e", "v6e"):
                us = sum(max(roofline_us(w[k], chip)[0], roofline_us(w[k], chip)[2])
                         for k in kernels)
                ms.append(us * n / 1e3)
            lines.append(f"| {op} | {plan} | {ms[0]:.2f} | {ms[1]:.2f} |")
    return "\n".join(lines)


_DOC = """# Pallas TPU kernels: roofline on paper (TPU v5e, v6e)

There is no TPU in this project's CI. The kernels in `pallas_kernels/tpu/` are checked for
correctness in the TPU interpreter and for lowering to Mosaic from CPU (`tests/test_pallas_tpu.py`);
their speed is estimated here, on paper. Every number below is generated by
`python -m tools.tpu_roofline --markdown` (`tools/tpu_roofline.py`), which **counts the work
from the kernels' own code**: `kernels.forward_chunk` / `kernels.backward_chunk` (exactly what one
grid step evaluates on its loaded blocks) are traced to a jaxpr at the block shapes and every
primitive is tallied. Re-run it after changing a kernel; the tables follow.

## Method and assumptions

* **Peaks (per chip, published):** TPU v5e 197 TFLOP/s bf16, 819 GB/s HBM
  ([cloud.google.com/tpu/docs/v5e](https://cloud.google.com/tpu/docs/v5e)); TPU v6e (Trillium)
  918 TFLOP/s bf16, 1638 GB/s HBM ([cloud.google.com/tpu/docs/v6e](https://cloud.google.com/tpu/docs/v6e)).
* **MXU:** `dot_general` FLOPs (2·M·N·K), charged in bf16 MXU passes by precision: fp32
  `HIGHEST` 6 (the `bf16_6x` emulation; see [jax-ml/jax#18934](https://github.com/jax-ml/jax/issues/18934)),
  `HIGH` 3 (`bf16x3`), bf16 operands 1. The kernels' policy (`pallas_kernels/tpu/algebra.py`):
  fp32 callers run every product at `HIGHEST`; bf16/fp16 callers run the backward's leaf products
  with bf16 operands (measured: gradients ≈ 4e-3 vs the 1e-2 / 2e-2 tolerances), the other
  products at `HIGH` (accuracy checked in the tests by emulating bf16x3 on CPU), and the gate
  cumsum and the triangular inverse at `HIGHEST`. "MXU µs" is the time as implemented;
  "all-bf16 MXU µs" is the same FLOPs at one pass (a floor, not an accuracy-preserving option).
* **HBM:** the bytes the BlockSpecs move per grid step: q, k, v (input dtype), gates (fp32; scalar
  gates / β as (8, C) row tiles — 8 chunks per tile, lanes padded to 128), o / dq, dk, dv, db, dw,
  dg, dO, plus S0 (K·V fp32) and R (C·V fp32) where the policy stores or reads them. The
  per-sequence state blocks (h0, final, dfinal, dh0) are read/written once per sequence and left
  out. The XLA work around the kernels (q/k L2-norm, the layout glue of D = 64 / varlen calls)
  is not counted; see "Outside the kernels".
* **EUP / VPU:** transcendental (`exp`) and other elementwise/reduction element counts. They are
  **not** in the MXU/HBM roofline (no published VPU/EUP peak), but they matter: see findings.
* **bound:** the larger of MXU (as implemented) and HBM time on v6e.
* Per chunk means one chunk (C = 64 rows) of one (batch, head); a sequence of T tokens has
  ⌈T/C⌉ chunks per head. The training-step tables sum max(MXU, HBM) over the kernels of one
  forward + backward (no overlap between kernels, no grid-step overhead).

What one grid step computes (rewy-math §3–§5): cumsum of the gate (ones matmul); e = b⊙k, z = w⊙v;
T = tril(Ē K̄ᵀ, −1) and P = tril(Qγ K̄ᵀ) (vector gates: one [8, C]×[C, K] frame product per 8-row
sub-chunk plus the exact per-pair diagonal sweep); A = (I+T)⁻¹ (forward substitution on 16×16
diagonal blocks + nilpotent block merge); W = AĒ, U = AZ; R = U − W S0; O = Qγ S0 + P R;
S_C = γ_C⊙S0 + K_tailᵀ R. The backward kernel recomputes these (or reads R with policy "save"),
then dR = Pᵀ dO + K_tail dS, Λ = Aᵀ dR, dT = −tril(Λ Rᵀ, −1), −Λ S0ᵀ, the Gram terms, the leaf
maps, dG and dS0 = Qγᵀ dO + γ_C⊙dS − Ēᵀ Λ. "states pass" is the forward kernel writing only S0 (the
recompute policy's extra pass).

## Findings

1. **Per chunk at K = V = 128, bf16 callers (table below):** forward ≈ 14–15 MFLOP, backward
   ≈ 30–31 MFLOP of MXU work. o's accuracy budget (rewy-math §8: 5e-3, with bf16 output rounding
   alone at ≈1.7e-3) rules out bf16 operands in the forward, so its products take fp32 operands
   at `HIGH` (bf16x3, 3 passes; the gate cumsum and the triangular inverse stay `HIGHEST`). The
   forward is MXU-bound on v5e (0.25–0.28 µs vs 0.08–0.20 µs of HBM) and HBM-bound or balanced on
   v6e; the backward (bf16 operands for its leaf products) is MXU-bound on v5e for DeltaNet/GDN
   and HBM-bound on v6e for every op (0.08–0.09 µs MXU vs 0.11–0.23 µs HBM).
2. **ReWY vs the seven-product backward:** the reduced core (Λ = AᵀdR, ΛRᵀ, ΛS0ᵀ) is 4.19 vs
   7.34 MFLOP at K = 128 (−43%); the whole backward kernel — which also rebuilds T, A, P, W, U and
   forms the Gram terms and leaf products common to both — does 9.5% fewer MXU FLOPs (14% at
   K = 64, 5.7% at K = 256). For fp32 callers (6-pass products) that is 9.5% less MXU time
   (0.195 vs 0.216 µs per chunk on v6e). For bf16 callers the seven-product extras are one-pass
   bf16 products, so the MXU gap is ≈3% (0.079 vs 0.082 µs), ≈2% of a v5e training step, and
   nothing on v6e, where the bf16 backward is HBM-bound. On TPU, ReWY's gain is FLOPs and VMEM
   (no C×C adjoint dA, no separate W/U cotangent paths); it becomes wall time where the backward
   is MXU-bound (fp32 callers, v5e) — and more so once the VPU work below is reduced.
3. **Policies:** "save" (S0 and R stored by the forward) removes the states pass and the W/U
   recomputation: at K = 128, bf16, B=8, H=16, T=4096 it cuts the roofline training step from
   7.2 to 4.6 ms on v5e (DeltaNet), while on v6e, HBM-bound, the extra S0/R traffic nearly
   cancels the saved work (1.93 → 1.89 ms). Its price is N·(K·V + C·V)·4 bytes per head.
4. **HBM layout choices that the tables reflect:** e = b⊙k and z = w⊙v are formed in-kernel
   (their fp32 copies never touch HBM; this halved the forward's bytes), and per-token scalars
   (gate, β) travel as dense (8, C) row tiles — a `[C, 1]` column block would have padded each
   scalar to 128 lanes in HBM (32 KiB per chunk instead of 0.5 KiB).
5. **The VPU, not the MXU, is the likely limit for vector gates (KDA, GDN2).** The exact
   per-pair diagonal sweep (finite for any g ≤ 0, rewy-math §3) costs ≈1.35 M elementwise ops
   per forward chunk and ≈3.0 M per backward chunk at K = 128, plus 155 k / 245 k `exp`. At one
   1024-element vector op per cycle (v6e's VPU is 128 lanes × 8 sublanes), 3.0 M ops are ≈2.9 k
   cycles — several times the backward's 0.14 µs MXU time at any GHz-class clock, even with
   several VALU slots per bundle. DeltaNet/GDN carry ≈0.36–0.72 M VPU ops per chunk (masks, the
   blocked inverse's row selects), comparable to their MXU time. Two changes already cut the
   vector-gate VPU work by half: 8-row instead of 16-row frame sub-chunks (+3% MXU FLOPs), and
   computing each pivot's decay factor, mask and pivot⊙decay product once per chunk and sharing
   them between the products that use them. Next steps, in order of payoff: the centred
   contraction for the diagonal blocks when the caller declares a gate lower bound (rewy-math §3:
   one small matmul instead of the sweep); fusing the backward's four sweeps (two `apply`, two
   `apply_t`) into one pass over the pivots; and moving the per-pivot column extraction of P
   (a [C, C] select and lane reduction per pivot) onto the MXU as one block-diagonal product.

## K = V = 128, C = 64, bf16 inputs
{t128}

## ReWY vs seven-product (WY) backward, per chunk (bf16 and fp32 callers)

Backward kernel with R recomputed (policy "recompute"). "core" counts only the products that
differ: ReWY's three (Λ = AᵀdR, ΛRᵀ, ΛS0ᵀ) vs WY's seven (dW = −dR S0ᵀ, dA = dR Zᵀ + dW Ēᵀ,
Aᵀ dU, Aᵀ dW, Aᵀ dA, (·)A).

{rw}

## One training step (forward + backward), roofline sum

{ts16}

{ts32}

## Appendix: K = V = 64 and 256 (bf16), K = V = 128 (fp32)
{t_other}
{t32}

## Outside the kernels: the layout glue (not in the tables)

For K and V multiples of 128 and no `cu_seqlens`, the kernels read and write the public layout
directly: `[B, T, H, D]` is viewed as `[B, T, H·D]` (a free reshape) and a (C, D) block at column
block h is a legal TPU tile, so q, k, v, o, vector gates and their gradients cross HBM once, as
counted above. What remains outside the kernels: a zero-pad of T to a multiple of C when T is not
one (one copy; none for the usual T), the per-token scalars (β, scalar g: `[B, T, H]` → (8, C)
row tiles, T·H·4 bytes, negligible), and the q/k L2-norm and scaling of the public ops. With
D = 64 or packed varlen (sequences re-laid to start on chunk boundaries), the backend still
transposes to the chunk layout `[B, H, N, C, D]`: one extra read and write of q, k, v (and vector
gates) before the forward, of o after it, of dO before the backward and of dq, dk, dv (db, dw,
dg) after it — at D = 64, bf16, ≈ 64 KiB around each of the forward and the backward per chunk,
comparable to the kernels' own traffic.

## Not modelled

* Grid-step overhead: a step here is one chunk of one head (0.1–0.5 µs of work); a fixed
  per-step pipeline cost is comparable. Processing several heads (or chunks of independent
  sequences) per grid step would amortise it; the kernels take one (b, h, chunk) per step today.
* DMA/compute overlap inside a kernel (Pallas double-buffers the BlockSpec inputs; the table
  assumes perfect overlap, i.e. max(MXU, HBM)).
* Megacore / multiple TensorCores: v5e and v6e have one TensorCore per chip; the batch and head
  grid axes are "parallel" for chips that have more.
* The final Mosaic compile (layout assignment): lowering is tested from CPU, compilation needs
  libtpu on a TPU host.
"""


def markdown() -> str:
    """benchmarks/tpu_roofline.md: the prose (its quoted numbers are from the tables at the time
    of writing) around freshly generated tables."""
    return _DOC.format(t128=tables(dims=(128,)), rw=rewy_vs_wy(), ts16=training_step(),
                       ts32=training_step(dtype=jnp.float32), t_other=tables(dims=(64, 256)),
                       t32=tables(dims=(128,), dtype=jnp.float32))


if __name__ == "__main__":
    import sys

    if "--markdown" in sys.argv:
        print(markdown(), end="")
        sys.exit()
    print(tables())
    print(tables(dims=(128,), dtype=jnp.float32))
    print()
    print(rewy_vs_wy())
    print()
    print(training_step())
    print()
    print(training_step(dtype=jnp.float32))
