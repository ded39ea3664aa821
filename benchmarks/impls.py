"""The implementations the harness times, behind one small interface.

Every implementation has a ``name`` (row label), a ``family`` (ours / jla / fla / autodiff),
``unavailable()`` -> reason or None (checked once: missing package, no GPU, backend not
registered) and ``unsupported(op, shape)`` -> reason or None.

JAX implementations provide ``call(op, q, k, v, gates, output_final_state) -> (o, final)``; the
harness jits and differentiates them (:class:`JaxRunner`). flash-linear-attention is PyTorch and
has its own runner (:class:`FlaRunner`): ``triton.testing.do_bench`` eagerly, or replays of a CUDA
graph captured after warm-up on a side stream.
"""

from __future__ import annotations

import functools
import importlib.util
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import autodiff_baseline
from benchmarks.inputs import gate_names
from benchmarks.shapes import CHUNK
from rewy_jax import testing

f32 = jnp.float32
PHASES = ("fwd", "fwdbwd")
# How JaxRunner times a fwd+bwd, recorded with every run: o and every input's gradient for the
# cotangent dO (testing.output_and_vjp), the form of the torch runners' torch.autograd.grad(o,
# inputs, grad_outputs=dO). Runs before this field timed value_and_grad of Σ o·dO, whose
# reduction over o and cast of dO (~0.05 ms at the anchor, profile-21) torch never paid.
JAX_FWDBWD = "o and its VJP for dO"
JAX_FWDBWD_BEFORE = "value_and_grad of Σ o·dO"


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _have(mod: str) -> bool:
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


# ----------------------------------------------------------------------------------------------
# JAX implementations
# ----------------------------------------------------------------------------------------------
class JaxImpl:
    framework = "jax"
    family = ""
    name = ""
    kernels = False  # Pallas/Mosaic kernels inside: compiled on the main thread (see run.py)
    fwd_key = None  # implementations with the same fwd_key share one forward (timed once)

    def unavailable(self):
        return None

    def unsupported(self, op, shape):
        return None

    def call(self, op, q, k, v, gates, output_final_state):
        raise NotImplementedError

    def accuracy_grads(self, op, inputs, cts):
        """(o, final, {d<name>: grad}) of ⟨o, dO⟩ + ⟨final, dS⟩, as testing.loss_and_grads."""
        names = ["q", "k", "v"] + list(gate_names(op))

        def loss(*diff):
            d = dict(zip(names, diff))
            gates = {n: d[n] for n in gate_names(op)}
            o, s = self.call(op, d["q"], d["k"], d["v"], gates, True)
            return (jnp.sum(o.astype(f32) * cts["o"].astype(f32))
                    + jnp.sum(s.astype(f32) * cts["final_state"].astype(f32))), (o, s)

        grads, (o, s) = jax.grad(loss, argnums=tuple(range(len(names))), has_aux=True)(
            *[inputs[n] for n in names])
        return o, s, {"d" + n: g for n, g in zip(names, grads)}


class Ours(JaxImpl):
    family = "ours"

    def __init__(self, backend: str, backward: str, policy: str, gate_bound: float | None = None,
                 kernel_config: dict | None = None):
        self.backend, self.backward, self.policy = backend, backward, policy
        # the Pallas GPU kernels' KernelConfig overrides for this run (run.py --kernel-config,
        # --variant); None: the measured defaults
        self.kernel_config = kernel_config if backend == "pallas_gpu" else None
        # gate_bound: declare g ≥ bound (chunk_kda/chunk_gdn2's gate_lower_bound; the benchmark's
        # gates, log σ(N(0,1) + 3), respect −5); only ops with vector gates take it
        self.gate_bound = gate_bound
        bound = "" if gate_bound is None else f" g≥{gate_bound:g}"
        self.name = f"ours {backend} {backward}/{policy}{bound}"
        self.fwd_key = f"ours {backend}{bound}"
        self.kernels = backend != "xla"

    def unavailable(self):
        from rewy_jax import backends

        if self.backend not in backends._TABLE:
            return f"backend {self.backend!r} is not registered in rewy_jax.backends"
        return None

    def unsupported(self, op, shape):
        B, T, H, D = shape
        if self.gate_bound is not None and op not in VECTOR_GATE_OPS:
            return "a declared gate bound only applies to vector gates (kda, gdn2)"
        tiny = testing.make_inputs(op, 1, CHUNK, H, D, dtype=jnp.bfloat16, initial_state=False)
        try:
            jax.eval_shape(lambda i: testing.run_op(op, i, **self.kwargs(op)), tiny)
        except NotImplementedError as e:
            return str(e)
        return None

    def kwargs(self, op):
        kw = dict(backend=self.backend, backward=self.backward, policy=self.policy,
                  chunk_size=CHUNK, use_qk_l2norm=False)
        if self.gate_bound is not None and op in VECTOR_GATE_OPS:
            kw["gate_lower_bound"] = self.gate_bound
        if self.kernel_config:
            kw["kernel_config"] = self.kernel_config
        return kw

    def call(self, op, q, k, v, gates, output_final_state):
        spec = testing.OPS[op]
        return spec.fn(q, k, v, *[gates[n] for n in spec.gates],
                       output_final_state=output_final_state, **self.kwargs(op))

    def accuracy_grads(self, op, inputs, cts):
        # The library's own accuracy tooling (rewy_jax.testing), the same path its tests use.
        o, s, grads = testing.loss_and_grads(op, inputs, cts, **self.kwargs(op))
        return o, s, grads


JLA_KIND = {"deltanet": "deltanet", "gdn": "gated_deltanet", "kda": "kda", "gdn2": "gdn2"}


class Jla(JaxImpl):
    family = "jla"

    def __init__(self, impl: str):
        self.impl = impl
        self.kernels = impl == "mosaic_gpu"
        self.name = {"mosaic_gpu": "jla mosaic_gpu", "chunked": "jla chunked"}.get(impl, f"jla {impl}")

    def unavailable(self):
        if not _have("jla"):
            return "jax-linear-attention (jla) is not installed"
        if self.impl == "mosaic_gpu" and not on_gpu():
            return "jla impl='mosaic_gpu' needs a CUDA GPU"
        return None

    def unsupported(self, op, shape):
        if self.impl != "mosaic_gpu":
            return None
        import jla.ops as jo

        jo._load_kernels()
        entry = jo._REGISTRY.get("mosaic_gpu", {}).get(JLA_KIND[op])
        if entry is None:
            return f"jla has no mosaic_gpu kernel for {JLA_KIND[op]}"
        B, T, H, D = shape
        sd = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)  # noqa: E731
        gates = _gate_structs(op, B, T, H, D)
        try:
            ok = entry[1](sd(B, T, H, D), sd(B, T, H, D), sd(B, T, H, D),
                          *[gates[n] for n in gate_names(op)], output_final_state=False)
        except Exception:  # noqa: BLE001 - the predicate wants real arrays: just try the call
            return None
        return None if ok else "jla mosaic_gpu supports() refuses this call"

    def call(self, op, q, k, v, gates, output_final_state):
        from jla.ops import linear_attention

        return linear_attention(JLA_KIND[op], q, k, v, impl=self.impl,
                                output_final_state=output_final_state, **gates)


def _gate_structs(op, B, T, H, D):
    spec = testing.OPS[op]
    out = {}
    for n, kind in zip(spec.gates, spec.gate_kinds):
        shape = (B, T, H) if kind in ("g_scalar", "beta") else (B, T, H, D)
        out[n] = jax.ShapeDtypeStruct(shape, jnp.float32)
    return out


class Autodiff(JaxImpl):
    family = "autodiff"
    name = "plain JAX autodiff"

    def call(self, op, q, k, v, gates, output_final_state):
        o, s = autodiff_baseline.op_call(op, q, k, v, gates)
        return o, (s if output_final_state else None)


# ----------------------------------------------------------------------------------------------
# Runners: compile, warm up, then one timing sample per call (the harness interleaves them)
# ----------------------------------------------------------------------------------------------
def _reason(e) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


def _mem_of(compiled):
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None
    if m is None:
        return None
    try:
        return int(m.temp_size_in_bytes + m.output_size_in_bytes - getattr(m, "alias_size_in_bytes", 0))
    except AttributeError:
        return None


def _all_finite(tree) -> bool:
    return all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree_util.tree_leaves(tree)
               if jnp.issubdtype(x.dtype, jnp.inexact))


class JaxRunner:
    """Times ``impl`` on rotated input sets: each sample runs ``reps`` back-to-back calls (each on
    the next set), blocks, and returns the mean per call in ms; the harness takes medians."""

    # ~20 ms of back-to-back calls per sample, so the host's dispatch of one call overlaps the
    # GPU's work on the previous one, as in a training loop and as do_bench gives the torch
    # runners. (Up to run h200-4 it was 3 ms: one or two calls of a 2 ms op per sample, each
    # sample paying one dispatch that nothing overlapped; untimed since the change.)
    def __init__(self, impl: JaxImpl, op: str, sets: list, do_sets: list, target_ms: float = 20.0):
        self.impl, self.op, self.sets, self.do_sets = impl, op, sets, do_sets
        self.target_ms = target_ms
        self.fns, self.reps, self.mem, self.refused = {}, {}, {}, {}
        self.nonfinite = []  # phases whose full-shape output or gradients hold a NaN/inf

    def compile(self, phases=PHASES):
        """Trace and compile (thread-safe: the harness compiles all runners of a group in parallel)."""
        impl, op = self.impl, self.op

        def fwd(x):
            return impl.call(op, x["q"], x["k"], x["v"], {n: x[n] for n in gate_names(op)}, False)[0]

        def fwd_bwd(x, do):  # JAX_FWDBWD: o and its VJP, as the torch runners' autograd.grad
            return testing.output_and_vjp(fwd, x, do)

        self.compiled = {}
        for ph in phases:
            try:
                if ph == "fwd":
                    c = jax.jit(fwd).lower(self.sets[0]).compile()
                else:
                    c = jax.jit(fwd_bwd).lower(self.sets[0], self.do_sets[0]).compile()
                self.compiled[ph] = c
                self.mem[ph] = _mem_of(c)
            except Exception as e:  # noqa: BLE001 - a refusal or failure is a result
                self.refused[ph] = _reason(e)

    def setup(self, phases=PHASES):
        if not hasattr(self, "compiled"):
            self.compile(phases)
        for ph, c in self.compiled.items():
            try:
                if ph == "fwd":
                    call = lambda i, c=c: c(self.sets[i % len(self.sets)])  # noqa: E731
                else:
                    call = lambda i, c=c: c(self.sets[i % len(self.sets)],  # noqa: E731
                                            self.do_sets[i % len(self.do_sets)])
                out = jax.block_until_ready(call(0))  # warm-up, at the full shape: finite?
                if not _all_finite(out):
                    self.nonfinite.append(ph)
                t0 = time.perf_counter()
                jax.block_until_ready(call(1))
                t = (time.perf_counter() - t0) * 1e3
                self.reps[ph] = int(max(1, min(64, round(self.target_ms / max(t, 1e-3)))))
                self.fns[ph] = call
            except Exception as e:  # noqa: BLE001
                self.refused[ph] = _reason(e)

    def sample(self, ph) -> float:
        call, n = self.fns[ph], self.reps[ph]
        t0 = time.perf_counter()
        out = None
        for i in range(n):
            out = call(i)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) * 1e3 / n

    def close(self):
        self.fns.clear()


class TorchFla:
    """flash-linear-attention 0.6.0 (PyTorch + Triton), eagerly or under a CUDA graph."""

    framework = "torch"
    family = "fla"
    fwd_key = None

    def __init__(self, graph: bool):
        self.graph = graph
        self.name = "FLA graph" if graph else "FLA eager"

    def unavailable(self):
        if not _have("torch"):
            return "PyTorch is not installed (flash-linear-attention needs it)"
        if not _have("fla"):
            return "flash-linear-attention (fla-core) is not installed"
        import torch

        if not torch.cuda.is_available():
            return "flash-linear-attention needs a CUDA GPU (its kernels are Triton)"
        if not on_gpu():
            return "JAX is not on the GPU in this process"
        return None

    def unsupported(self, op, shape):
        return None

    @staticmethod
    @functools.cache
    def fns():
        from fla.ops import chunk_delta_rule, chunk_gated_delta_rule, chunk_kda
        from fla.ops.gdn2 import chunk_gdn2

        return {"deltanet": chunk_delta_rule, "gdn": chunk_gated_delta_rule, "kda": chunk_kda,
                "gdn2": chunk_gdn2}

    def call(self, op, q, k, v, gates, output_final_state):
        fn = self.fns()[op]
        return fn(q, k, v, *[gates[n] for n in gate_names(op)], output_final_state=output_final_state)

    def accuracy_grads(self, op, inputs, cts):
        """Same loss as the JAX path; returns numpy arrays. Backward refusals raise."""
        import torch

        dev = "cuda"
        t = {}
        for n, x in inputs.items():
            dt = torch.bfloat16 if n in ("q", "k", "v") else torch.float32
            t[n] = torch.tensor(np.asarray(x, np.float32), device=dev).to(dt).requires_grad_(True)
        o, s = self.call(op, t["q"], t["k"], t["v"], {n: t[n] for n in gate_names(op)}, True)
        out_o, out_s = o.detach().float().cpu().numpy(), s.detach().float().cpu().numpy()
        names = ["q", "k", "v"] + list(gate_names(op))
        do = torch.tensor(np.asarray(cts["o"], np.float32), device=dev)
        dS = torch.tensor(np.asarray(cts["final_state"], np.float32), device=dev)
        loss = (o.float() * do).sum() + (s.float() * dS).sum()
        try:
            grads = torch.autograd.grad(loss, [t[n] for n in names])
        except Exception as e:  # noqa: BLE001
            return out_o, out_s, {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        return out_o, out_s, {"d" + n: g.float().cpu().numpy() for n, g in zip(names, grads)}


def _torch_from_jax(x):
    import torch

    return torch.from_dlpack(x).clone()


class FlaRunner:
    """Eager: ``triton.testing.do_bench`` (median; it clears L2 before each call) over rotated
    input sets. Graph: one CUDA graph that runs every input set once, captured after warm-up on a
    side stream; a sample is ``do_bench`` of its replay divided by the number of sets."""

    def __init__(self, impl: TorchFla, op: str, sets: list, do_sets: list, rep_ms: int = 40):
        self.impl, self.op = impl, op
        self.rep_ms = rep_ms
        self.fns, self.mem, self.refused, self.reps = {}, {}, {}, {}
        names = ["q", "k", "v"] + list(gate_names(op))
        self.names = names
        self.sets = [{n: _torch_from_jax(s[n]).requires_grad_(True) for n in names} for s in sets]
        self.do_sets = [_torch_from_jax(d) for d in do_sets]
        self.graphs = []

    def _fwd(self, i):
        s = self.sets[i % len(self.sets)]
        return self.impl.call(self.op, s["q"], s["k"], s["v"], {n: s[n] for n in gate_names(self.op)},
                              False)[0]

    def _fwdbwd(self, i):
        import torch

        s = self.sets[i % len(self.sets)]
        o = self._fwd(i)
        return torch.autograd.grad(o, [s[n] for n in self.names], grad_outputs=self.do_sets[i % len(self.do_sets)])

    def setup(self, phases=PHASES):
        import torch

        for ph in phases:
            body = self._fwd if ph == "fwd" else self._fwdbwd
            try:
                with torch.no_grad() if ph == "fwd" else torch.enable_grad():
                    body(0)  # first call: Triton compiles and autotunes here
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                with torch.no_grad() if ph == "fwd" else torch.enable_grad():
                    out = body(1)
                torch.cuda.synchronize()
                self.mem[ph] = int(torch.cuda.max_memory_allocated() - base)
                del out
                if self.impl.graph:
                    self.fns[ph] = self._capture(ph, body)
                else:
                    counter = [0]

                    def run(body=body, counter=counter, ph=ph):
                        counter[0] += 1
                        with torch.no_grad() if ph == "fwd" else torch.enable_grad():
                            return body(counter[0])

                    self.fns[ph] = run
            except Exception as e:  # noqa: BLE001 - a refusal or failure is a result
                msg = str(e).splitlines()[0][:300] if str(e) else ""
                self.refused[ph] = f"{type(e).__name__}: {msg}"
                torch.cuda.synchronize()

    def _capture(self, ph, body):
        import torch

        n = len(self.sets)
        ctx = torch.no_grad if ph == "fwd" else torch.enable_grad
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), ctx():
            for _ in range(2):
                for i in range(n):
                    body(i)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        # thread_local: only this thread's unsafe CUDA calls invalidate the capture. Under
        # torch's default "global" mode a capture failed twice with "operation failed due to a
        # previous error during capture" (runs h200-11 and h200-12, GDN) and left the process's
        # CUDA context unusable; JAX's runtime threads share the process, the likely culprit.
        # Not yet seen on the GPU with this setting (no device time left when it was made).
        with torch.cuda.graph(g, capture_error_mode="thread_local"), ctx():
            outs = [body(i) for i in range(n)]
        self.graphs.append((g, outs))
        self.reps[ph] = n
        return g.replay

    def sample(self, ph) -> float:
        import triton.testing

        ms = triton.testing.do_bench(self.fns[ph], warmup=5, rep=self.rep_ms, return_mode="median")
        return ms / (len(self.sets) if self.impl.graph else 1)

    def close(self):
        import torch

        self.fns.clear()
        self.graphs.clear()
        self.sets.clear()
        self.do_sets.clear()
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# The list
# ----------------------------------------------------------------------------------------------
VECTOR_GATE_OPS = ("kda", "gdn2")
OUR_VARIANTS_FULL = [("rewy", "recompute"), ("rewy", "save"), ("wy", "recompute"), ("wy", "save")]
# Quick mode: the kernel backend's ReWY and seven-product backward under both policies (Mosaic:
# the seven-product one under "recompute", its default policy, for the ablation: DeltaNet and
# GDN at K ≤ 128 only); the XLA path's default only (each variant costs compile time, and the
# quick run must fit one call: select fewer with --impls).
OUR_VARIANTS_QUICK = {"pallas_gpu": [("rewy", "recompute"), ("rewy", "save"), ("wy", "recompute"),
                                     ("wy", "save")],
                      "mosaic_gpu": [("rewy", "recompute"), ("rewy", "save"), ("wy", "recompute")],
                      "xla": [("rewy", "recompute")]}


def our_backends() -> list[str]:
    """Backends of ours to time: a registered Pallas GPU backend first (if any), then xla."""
    from rewy_jax import backends

    out = []
    if "pallas_gpu" in backends._TABLE:
        out.append("pallas_gpu")
    out.append("xla")
    return out


def all_impls(quick: bool, backends_=None, kernel_config=None) -> list:
    """kernel_config: KernelConfig overrides for every pallas_gpu row (None: the defaults)."""
    impls = []
    for be in (backends_ or our_backends()):
        variants = OUR_VARIANTS_QUICK.get(be, OUR_VARIANTS_QUICK["xla"]) if quick else OUR_VARIANTS_FULL
        for bw, pol in variants:
            impls.append(Ours(be, bw, pol, kernel_config=kernel_config))
        if be in ("pallas_gpu", "mosaic_gpu"):  # the centred path a declared gate bound enables
            impls.append(Ours(be, "rewy", "recompute", -5.0, kernel_config))
            if be == "pallas_gpu":  # (the Mosaic KDA/GDN2 kernels have the ReWY backward only)
                impls.append(Ours(be, "wy", "recompute", -5.0, kernel_config))
    impls += [Jla("mosaic_gpu"), Jla("chunked"), TorchFla(graph=False), TorchFla(graph=True),
              Autodiff()]
    return impls
