"""Roofline floor of one delta-rule call, counted from the shapes (METHOD.md, "two numbers first").

FLOPs: the matmul FLOPs (2 per multiply-add) of the chunked WY algorithm (rewy-math §3), per chunk
of C rows and per (batch, head), K key dim, V value dim:

    T  = tril(Ē K̄ᵀ)          2·C²·K
    W  = A Ē                 2·C²·K          (A = (I + T)⁻¹: C³/3 multiply-adds, 2/3·C³)
    U  = A Z                 2·C²·V
    W S0                     2·C·K·V
    Qγ S0                    2·C·K·V
    Qγ K̄ᵀ (masked)           2·C²·K
    P R                      2·C²·V
    K_tailᵀ R (state update) 2·C·K·V
    ------------------------------------------------------
    forward  = 6·C²·K + 4·C²·V + 6·C·K·V + 2/3·C³   per chunk,  × B·H·⌈T/C⌉ chunks
    backward = 2 × forward (each product x = a·b needs da = dx·bᵀ and db = aᵀ·dx; no recompute)

Bytes: each input read once and each output written once (the minimum device-memory traffic):

    forward  = q + k + v (bf16) + gates (fp32) + o (bf16)
    backward = dO (bf16) + dq + dk + dv (bf16) + d(gates) (fp32)
    fwd+bwd  = forward + backward (inputs counted once)

gates: DeltaNet β [B,T,H]; GDN g, β [B,T,H]; KDA g [B,T,H,K], β [B,T,H];
GDN2 g, b [B,T,H,K], w [B,T,H,V].

Floor time = max(FLOPs / measured bf16 matmul rate, bytes / measured copy bandwidth), both
ceilings measured in the same run (:func:`measure_ceilings`).
"""

from __future__ import annotations

import math
import time

BF16 = 2
FP32 = 4


def gate_elems(op: str, B: int, T: int, H: int, K: int, V: int) -> int:
    n = B * T * H
    return {"deltanet": n, "gdn": 2 * n, "kda": n * K + n, "gdn2": n * K * 2 + n * V}[op]


def flops(op: str, B: int, T: int, H: int, K: int, V: int, C: int = 64) -> dict:
    """Matmul FLOPs of forward, backward and fwd+bwd (see module docstring)."""
    del op  # the gate form changes elementwise work only; the matmuls are the same
    n_chunks = B * H * math.ceil(T / C)
    fwd = n_chunks * (6 * C * C * K + 4 * C * C * V + 6 * C * K * V + (2 * C ** 3) / 3)
    bwd = 2 * fwd
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}


def bytes_moved(op: str, B: int, T: int, H: int, K: int, V: int) -> dict:
    """Minimum device-memory bytes of forward, backward and fwd+bwd (see module docstring)."""
    qkv = B * T * H * (2 * K + V) * BF16
    gates = gate_elems(op, B, T, H, K, V) * FP32
    o = B * T * H * V * BF16
    fwd = qkv + gates + o
    bwd = o + qkv + gates  # dO in; dq, dk, dv, d(gates) out
    return {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}


def floor_ms(op: str, shape, ceilings: dict, C: int = 64) -> dict:
    """Floor time (ms) per phase and which term binds, from measured ceilings
    ``{"matmul_tflops": ..., "copy_tbps": ...}``."""
    B, T, H, D = shape
    fl, by = flops(op, B, T, H, D, D, C), bytes_moved(op, B, T, H, D, D)
    out = {}
    for ph in ("fwd", "bwd", "fwdbwd"):
        t_fl = fl[ph] / (ceilings["matmul_tflops"] * 1e12) * 1e3
        t_by = by[ph] / (ceilings["copy_tbps"] * 1e12) * 1e3
        out[ph] = {"ms": max(t_fl, t_by), "bound": "matmul" if t_fl >= t_by else "memory",
                   "flops": fl[ph], "bytes": by[ph]}
    return out


def measure_ceilings(n: int = 8192, copy_bytes: int = 2 << 30, reps: int = 10) -> dict:
    """bf16 matmul rate (n×n×n, random data) and device-to-device copy bandwidth (bytes read +
    written) through JAX on the default device. Medians of ``reps`` timed runs after warm-up."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    on_cpu = jax.default_backend() == "cpu"
    if on_cpu:  # keep the smoke run quick; the numbers are not meaningful on a CPU anyway
        n, copy_bytes, reps = 512, 64 << 20, 3
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    mm = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    x = jax.random.normal(ka, (copy_bytes // 4,), jnp.float32)
    cp = jax.jit(lambda x: x * 1.0001)  # one read and one write of every element

    def med(f, *args):
        jax.block_until_ready(f(*args))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    t_mm = med(mm, a, b)
    t_cp = med(cp, x)
    return {"matmul_tflops": 2 * n ** 3 / t_mm / 1e12, "copy_tbps": 2 * x.nbytes / t_cp / 1e12,
            "matmul_n": n, "copy_bytes": int(x.nbytes), "method": "jax, wall clock, median"}
