"""Roofline of the TPU kernels on paper: FLOPs and HBM bytes per chunk, time on TPU v5e / v6e.

The work is *counted from the kernels themselves*: ``kernels.forward_chunk`` and
``kernels.backward_chunk`` (exactly what one grid step computes) are traced to a jaxpr on the
block shapes and every primitive is tallied:

* MXU: ``dot_general`` FLOPs (2·M·N·K). All products are fp32 ``Precision.HIGHEST``; on the TPU
  MXU that is the 6-pass bf16 emulation (``bf16_6x``, see jax-ml/jax#18934 and
  ``jax.lax.Precision``), so the fp32 roofline charges 6 bf16 passes per FLOP. A "bf16 operands"
  column shows the same FLOPs at one pass (what bf16 matmul operands would cost).
* EUP: transcendentals (``exp``) — element count.
* VPU: other elementwise/reduction ops — element count (not in the roofline: no published VPU
  peak; listed so the vector-gate pivot sweep's cost is visible).

HBM bytes per chunk come from the BlockSpecs (what the pipeline DMAs per grid step); the
per-sequence state blocks (h0, final, dfinal, dh0: K·V·4 each) are amortised over a sequence and
left out. Peaks (published, per chip): v5e 197 TFLOP/s bf16, 819 GB/s HBM
(https://cloud.google.com/tpu/docs/v5e); v6e 918 TFLOP/s bf16, 1638 GB/s HBM
(https://cloud.google.com/tpu/docs/v6e).

Run: ``python -m pallas_kernels.tpu.roofline`` (prints the Markdown tables of
benchmarks/tpu_roofline.md).
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
         "transpose", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call", "copy",
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
            exact = lhs.dtype == jnp.float32  # fp32 operands run at Precision.HIGHEST
            tally["mxu_flops"] += flops
            tally["mxu_fp32_flops"] += flops if exact else 0
            tally["mxu_pass_flops"] += flops * (FP32_PASSES if exact else 1)
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


if __name__ == "__main__":
    print(tables())
    print(tables(dims=(128,), dtype=jnp.float32))
    print()
    print(rewy_vs_wy())
    print()
    print(training_step())
    print()
    print(training_step(dtype=jnp.float32))
