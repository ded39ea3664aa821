"""Accuracy tooling shared by the tests, the demo and the benchmarks (rewy-math §8).

* :data:`OPS` — the four ops by short name, with the names of their gate arguments.
* :func:`make_inputs` — random inputs for an op (fresh draws; strong decays optional).
* :func:`ratio` — ``‖x − ref‖_rms / ‖ref‖_rms``.
* :func:`accuracy_report` — every output and gradient of an op against the float64 token
  recurrence, as ratios, with the §8 thresholds.
* :class:`Case`, :func:`random_case` — a whole random accuracy case (op, shape, gates, packing,
  backward scheme, policy, dtype) for sweeps and property tests.

The float64 oracle needs ``jax.config.update("jax_enable_x64", True)`` (done by
:func:`accuracy_report` on entry when needed).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rewy_jax import ops


class OpSpec(NamedTuple):
    name: str
    fn: callable
    gates: tuple  # gate argument names in call order after q, k, v
    gate_kinds: tuple  # per gate: "g_scalar", "g_vector", "beta", "b", "w"


OPS = {
    "deltanet": OpSpec("deltanet", ops.chunk_delta_rule, ("beta",), ("beta",)),
    "gdn": OpSpec("gdn", ops.chunk_gated_delta_rule, ("g", "beta"), ("g_scalar", "beta")),
    "kda": OpSpec("kda", ops.chunk_kda, ("g", "beta"), ("g_vector", "beta")),
    "gdn2": OpSpec("gdn2", ops.chunk_gdn2, ("g", "b", "w"), ("g_vector", "b", "w")),
}

# rewy-math §8 thresholds on the ratio metric.
FP32_TOL = 1e-4
BF16_TOL = {"o": 5e-3, "final_state": 5e-3, "dq": 1e-2, "dk": 1e-2, "dv": 1e-2,
            "dinitial_state": 1e-2, "dg": 2e-2, "dbeta": 2e-2, "db": 2e-2, "dw": 2e-2}


def tolerance(name: str, dtype) -> float:
    if jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)):
        return FP32_TOL
    return BF16_TOL[name]


def ratio(x, ref) -> float:
    """‖x − ref‖_rms / ‖ref‖_rms in float64 (inf if x has NaN/Inf)."""
    x = np.asarray(jnp.asarray(x, jnp.float32), np.float64) if jnp.asarray(x).dtype == jnp.bfloat16 \
        else np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(x)):
        return float("inf")
    den = np.sqrt(np.mean(ref ** 2))
    num = np.sqrt(np.mean((x - ref) ** 2))
    return float(num / den) if den > 0 else float(num)


def make_inputs(op: str, B: int, T: int, H: int, K: int, V: int | None = None, *,
                dtype=jnp.float32, seed: int = 0, decay: str = "normal",
                initial_state: bool = True, n_seqs: int | None = None) -> dict:
    """Random inputs for ``OPS[op]`` as a dict of keyword arrays.

    decay: "normal" (g = log-sigmoid of N(2, 1)-ish, mild), "strong" (g down to −10, some −50
    and −inf), "resets" ("normal" with 10% of the gates −inf and 10% −50: resets inside every
    chunk), "bounded" (g uniform in [−5, 0], a tenth exactly −5: the strongest decays that
    ``gate_lower_bound=-5`` admits) or "none" (g = 0). β, b ∈ [0, 2]; w ∈ [0, 2]. q, k unnormalised (pass
    use_qk_l2norm=True as the layers do). With ``n_seqs`` (B must be 1), also random
    ``cu_seqlens`` of that many sequences and per-sequence initial states.
    """
    V = K if V is None else V
    spec = OPS[op]
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    out = {"q": f(B, T, H, K), "k": f(B, T, H, K), "v": f(B, T, H, V)}
    for name, kind in zip(spec.gates, spec.gate_kinds):
        if kind in ("g_scalar", "g_vector"):
            shape = (B, T, H) if kind == "g_scalar" else (B, T, H, K)
            if decay == "none":
                g = np.zeros(shape, np.float32)
            elif decay == "strong":
                g = -rng.uniform(0, 10, shape).astype(np.float32)
                flat = g.reshape(-1)
                idx = rng.choice(flat.size, size=max(1, flat.size // 50), replace=False)
                flat[idx[: len(idx) // 2]] = -50.0
                flat[idx[len(idx) // 2:]] = -np.inf
            elif decay == "resets":
                g = np.log(1 / (1 + np.exp(-(rng.standard_normal(shape) + 3.0)))).astype(np.float32)
                u = rng.uniform(size=shape)
                g[u < 0.1] = -np.inf
                g[(u >= 0.1) & (u < 0.2)] = -50.0
            elif decay == "bounded":
                g = -rng.uniform(0, 5, shape).astype(np.float32)
                g[rng.uniform(size=shape) < 0.1] = -5.0
            else:
                g = np.log(1 / (1 + np.exp(-(rng.standard_normal(shape) + 3.0)))).astype(np.float32)
            out[name] = g
        elif kind == "beta":
            out[name] = rng.uniform(0, 2, (B, T, H)).astype(np.float32)
        elif kind == "b":
            out[name] = rng.uniform(0, 2, (B, T, H, K)).astype(np.float32)
        elif kind == "w":
            out[name] = rng.uniform(0, 2, (B, T, H, V)).astype(np.float32)
    lead = B
    if n_seqs is not None:
        if B != 1:
            raise ValueError("n_seqs needs B = 1")
        cuts = np.sort(rng.choice(np.arange(1, T), size=n_seqs - 1, replace=False)) if n_seqs > 1 else []
        out["cu_seqlens"] = np.concatenate([[0], cuts, [T]]).astype(np.int32)
        lead = n_seqs
    if initial_state:
        out["initial_state"] = f(lead, H, K, V)
    return {k: (jnp.asarray(v) if k == "cu_seqlens" else jnp.asarray(v, dtype if k in ("q", "k", "v") else jnp.float32))
            for k, v in out.items()}


def _diff_names(inputs: dict) -> list[str]:
    return [k for k in inputs if k != "cu_seqlens"]


def run_op(op: str, inputs: dict, **kw):
    """Call ``OPS[op]`` on ``inputs`` (q, k, v, gates positionally; the rest by keyword)."""
    spec = OPS[op]
    args = [inputs["q"], inputs["k"], inputs["v"]] + [inputs[n] for n in spec.gates]
    extra = {k: inputs[k] for k in ("initial_state", "cu_seqlens") if k in inputs}
    return spec.fn(*args, output_final_state=True, **extra, **kw)


def loss_and_grads(op: str, inputs: dict, cotangents: dict, **kw):
    """Outputs (o, final) and gradients of ⟨o, dO⟩ + ⟨final, dS⟩ w.r.t. every float input."""
    names = _diff_names(inputs)

    def loss(*diff):
        full = dict(inputs, **dict(zip(names, diff)))
        o, s = run_op(op, full, **kw)
        acc = jnp.promote_types(o.dtype, jnp.float32)
        return (jnp.sum(o.astype(acc) * cotangents["o"].astype(acc))
                + jnp.sum(s.astype(acc) * cotangents["final_state"].astype(acc))), (o, s)

    grads, (o, s) = jax.grad(loss, argnums=tuple(range(len(names))), has_aux=True)(
        *[inputs[n] for n in names])
    return o, s, dict(zip(["d" + n for n in names], grads))


def output_and_vjp(f, x, ct):
    """(o = f(x), the gradient of x for the cotangent ``ct`` on o): the JAX form of torch's
    ``torch.autograd.grad(o, x, grad_outputs=ct)`` — how the GPU benchmark and trace time a
    fwd+bwd: o is returned, so its computation is not dead code, and no loss is reduced. ``ct``
    is cast to o's dtype (a no-op when they match, as in the benchmark)."""
    o, pullback = jax.vjp(f, x)
    return o, pullback(ct.astype(o.dtype))[0]


# Keyword arguments of the ops that select an implementation but do not change the result.
_EXECUTION_ONLY = ("backend", "chunk_size", "policy", "backward", "interpret", "kernel_config")


def accuracy_report(op: str, inputs: dict, *, seed: int = 1, use_qk_l2norm: bool = True, **kw) -> dict:
    """Ratios of every output and gradient of ``op`` (with ``kw``, e.g. backend=...) against the
    float64 token recurrence on the same inputs. Returns {name: (ratio, tolerance)}."""
    dtype = inputs["q"].dtype
    return {name: (ratio(x, ref), tolerance(name, dtype)) for name, (x, ref) in
            compare_to_reference(op, inputs, seed=seed, use_qk_l2norm=use_qk_l2norm, **kw).items()}


def compare_to_reference(op: str, inputs: dict, *, seed: int = 1, use_qk_l2norm: bool = True,
                         **kw) -> dict:
    """{name: (value, float64 reference)} for o, final_state and every gradient of ⟨o, dO⟩ +
    ⟨final, dS⟩ (random cotangents drawn from ``seed``): what ``accuracy_report`` compares."""
    if not jax.config.jax_enable_x64:
        jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(seed)
    B, T, H, _ = inputs["q"].shape
    V = inputs["v"].shape[-1]
    K = inputs["q"].shape[-1]
    lead = inputs["initial_state"].shape[0] if "initial_state" in inputs else (
        len(inputs["cu_seqlens"]) - 1 if "cu_seqlens" in inputs else B)
    cts = {"o": jnp.asarray(rng.standard_normal((B, T, H, V))),
           "final_state": jnp.asarray(rng.standard_normal((lead, H, K, V)))}
    o, s, grads = loss_and_grads(op, inputs, {k: v.astype(jnp.float32) for k, v in cts.items()},
                                 use_qk_l2norm=use_qk_l2norm, **kw)
    ref_inputs = {k: (v if k == "cu_seqlens" else jnp.asarray(v, jnp.float64)) for k, v in inputs.items()}
    # The oracle must compute the same function: pass on every argument that changes the math
    # (e.g. scale); drop only those that choose how it is computed.
    ref_kw = {k: v for k, v in kw.items() if k not in _EXECUTION_ONLY}
    o_r, s_r, grads_r = loss_and_grads(op, ref_inputs, cts, use_qk_l2norm=use_qk_l2norm,
                                       backend="reference", **ref_kw)
    return {"o": (o, o_r), "final_state": (s, s_r),
            **{name: (gval, grads_r[name]) for name, gval in grads.items()}}


class Case(NamedTuple):
    """One random accuracy case: an op's shape, gates, packing and implementation choices."""
    op: str
    B: int
    T: int
    H: int
    K: int
    V: int
    chunk_size: int
    decay: str  # make_inputs' decay; "bounded" also declares gate_lower_bound=-5 (vector gates)
    backward: str  # "rewy" | "wy"
    policy: str  # "recompute" | "save"
    initial_state: bool
    n_seqs: int | None  # packed sequences (cu_seqlens), B = 1
    dtype: str  # "float32" | "bfloat16"

    def label(self) -> str:
        pack = f" n_seqs={self.n_seqs}" if self.n_seqs else ""
        h0 = " h0" if self.initial_state else ""
        return (f"{self.op} B={self.B} T={self.T} H={self.H} K={self.K} V={self.V} "
                f"C={self.chunk_size} {self.decay} {self.backward}/{self.policy}{h0}{pack} "
                f"{self.dtype}")

    def inputs(self, seed: int) -> dict:
        return make_inputs(self.op, self.B, self.T, self.H, self.K, self.V,
                           dtype=jnp.dtype(self.dtype), seed=seed, decay=self.decay,
                           initial_state=self.initial_state, n_seqs=self.n_seqs)

    def kwargs(self) -> dict:
        """The op's keyword arguments that this case fixes (add backend=... and the like)."""
        kw = dict(chunk_size=self.chunk_size, backward=self.backward, policy=self.policy)
        if self.decay == "bounded" and "g_vector" in OPS[self.op].gate_kinds:
            kw["gate_lower_bound"] = -5.0
        return kw

    def report(self, seed: int, **kw) -> dict:
        """accuracy_report on this case's inputs drawn from ``seed`` (cotangents from seed + 1)."""
        return accuracy_report(self.op, self.inputs(seed), seed=seed + 1, **self.kwargs(), **kw)


DECAYS = ("normal", "strong", "bounded", "none")  # random_case's default draw
ALL_DECAYS = DECAYS + ("resets",)  # make_inputs' regimes (random_case(decays=...) takes any)


def random_case(rng: np.random.Generator, *, dims=(16, 32), max_T: int = 150,
                dtypes=("float32", "float32", "bfloat16"), ops=None, decays=None) -> Case:
    """A random :class:`Case`: any op, T not a multiple of the chunk most of the time, K = V or
    not, every regime of :data:`DECAYS` (or those in ``decays``, from :data:`ALL_DECAYS`;
    repeat one to weight it), both backward schemes and policies, initial states and packed
    sequences half the time each, β/b/w in [0, 2] (make_inputs)."""
    for d in decays or ():
        if d not in ALL_DECAYS:
            raise ValueError(f"decays must hold names from {ALL_DECAYS}; got {d!r}")
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    n_seqs = pick([None, None, 2, 3])
    return Case(op=pick(sorted(ops or OPS)), B=1 if n_seqs else int(rng.integers(1, 3)),
                T=int(rng.integers(n_seqs or 1, max_T + 1)), H=int(rng.integers(1, 3)),
                K=pick(dims), V=pick(dims), chunk_size=pick([16, 32, 64]),
                decay=pick(list(decays or DECAYS)),
                backward=pick(["rewy", "wy"]), policy=pick(["recompute", "save"]),
                initial_state=bool(rng.integers(2)), n_seqs=n_seqs, dtype=pick(dtypes))
