"""Benchmark inputs: bf16 q/k/v with q, k L2-normalised, fp32 gates.

Accuracy inputs come from :func:`rewy_jax.testing.make_inputs` (numpy draws, small shapes). Timing
inputs at the benchmark sizes (up to ~0.5 GB a set) are drawn on the device with ``jax.random``
from the same distributions (numpy would take seconds per set); several independent sets are
drawn so that consecutive timed calls read different memory (``n_sets``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from rewy_jax import testing
from rewy_jax.reference import l2norm

GATE_SHAPES = {  # per gate kind: trailing feature axis (None: [B,T,H]; "K"/"V": [B,T,H,D])
    "g_scalar": None, "g_vector": "K", "beta": None, "b": "K", "w": "V",
}


def gate_names(op: str) -> tuple:
    return testing.OPS[op].gates


def device_inputs(op: str, B: int, T: int, H: int, K: int, V: int | None = None, *, seed: int = 0,
                  dtype=jnp.bfloat16) -> dict:
    """One input set on the default device, same distributions as ``testing.make_inputs``
    (decay="normal"): q, k ~ N(0,1) then L2-normalised; v ~ N(0,1); g = log σ(N(0,1) + 3);
    β, b, w ~ U(0, 2). Returns {"q","k","v", gate names...}; q/k/v in ``dtype``, gates fp32."""
    V = K if V is None else V
    n_keys = 3 + len(testing.OPS[op].gates)
    return _maker(op, B, T, H, K, V, jnp.dtype(dtype))(jax.random.split(jax.random.PRNGKey(seed), n_keys))


@functools.lru_cache(maxsize=64)
def _maker(op, B, T, H, K, V, dtype):
    spec = testing.OPS[op]
    f32 = jnp.float32

    @jax.jit
    def make(keys):
        q = l2norm(jax.random.normal(keys[0], (B, T, H, K), f32)).astype(dtype)
        k = l2norm(jax.random.normal(keys[1], (B, T, H, K), f32)).astype(dtype)
        v = jax.random.normal(keys[2], (B, T, H, V), f32).astype(dtype)
        out = {"q": q, "k": k, "v": v}
        for i, (name, kind) in enumerate(zip(spec.gates, spec.gate_kinds)):
            tail = GATE_SHAPES[kind]
            shape = (B, T, H) + (() if tail is None else ((K,) if tail == "K" else (V,)))
            key = keys[3 + i]
            if kind.startswith("g_"):
                out[name] = jax.nn.log_sigmoid(jax.random.normal(key, shape, f32) + 3.0)
            else:
                out[name] = jax.random.uniform(key, shape, f32, 0.0, 2.0)
        return out

    return make


def accuracy_inputs(op: str, B: int, T: int, H: int, K: int, *, seed: int = 0,
                    dtype=jnp.bfloat16) -> dict:
    """Small accuracy inputs from ``testing.make_inputs`` (no initial state), q and k
    L2-normalised in fp32 and then rounded to ``dtype``. Returns numpy arrays (q/k/v hold the
    rounded values in float32) so they can travel to the float64 reference process."""
    inp = testing.make_inputs(op, B, T, H, K, dtype=jnp.float32, seed=seed, initial_state=False)
    out = {}
    for name, x in inp.items():
        if name in ("q", "k"):
            x = l2norm(x)
        if name in ("q", "k", "v"):
            x = x.astype(dtype).astype(jnp.float32)
        out[name] = np.asarray(x, np.float32)
    return out


def accuracy_cotangents(inputs: dict, *, seed: int = 1) -> dict:
    """Random cotangents for o [B,T,H,V] and the final state [B,H,K,V] (float64)."""
    rng = np.random.default_rng(seed)
    B, T, H, K = inputs["q"].shape
    V = inputs["v"].shape[-1]
    return {"o": rng.standard_normal((B, T, H, V)), "final_state": rng.standard_normal((B, H, K, V))}


def nbytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))
