"""The Mosaic GPU kernels of several commits, each alone, timed side by side in one GPU call.

For bisecting a kernel's speed when GPU time is scarce:

    python -m benchmarks.kernel_ab prepare 2e26da4 af26ff4 HEAD   # here: git archive -> .ab/<label>/
    python -m benchmarks.kernel_ab run [--cases t0,vector_chunk_centred,...] [--limit 60]
                                                                  # on the GPU machine, .ab carried

``prepare`` extracts each commit's ``pallas_kernels/`` and ``rewy_jax/`` into ``.ab/<label>/``
(git-ignored; the GPU machine's copy of the tree has no git history, so carry ``.ab``). ``run``
times every tree in its own process (``PYTHONPATH=.ab/<label>:.``: the kernels and the op's glue
around them from the tree, the benchmark code from the working tree), on the same random inputs at the anchor shape, with
``benchmarks.mosaic_kernels.time_ms`` (host-timed loops: a kernel under ~0.1 ms reads high, see
docs/performance-log.md), each tree under its own time limit, and prints one table, case by
tree. A case a tree cannot run (an argument it does not take yet) shows the error's type.

Cases (KDA for the vector kernels; "centred": a declared bound g ≥ −5; "exact": undeclared
gates with resets, every chunk in the exact frames; "runtime": undeclared gates in [−1, 0],
which trees with per-chunk frames run centred; "inv": the chunk kernel also writing A's split pair,
as policy "save" and the recompute backward run it; ``forward_gdn`` and ``state_backward_gdn``:
GDN's serial passes alone in the layout the op picks at the anchor (key rows), ``_value_rows``
in value rows; ``backward_passes_gdn``: the recompute policy's states-only forward and reverse
state pass as the tree's backward runs them, one launch (launch.py) or two):
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys

import numpy as np

CASES = ("t0", "forward_gdn", "forward_gdn_value_rows", "state_backward_gdn", "state_backward_gdn_value_rows",
         "chunk_backward_deltanet", "vector_chunk_centred", "vector_chunk_exact", "vector_chunk_runtime",
         "vector_chunk_inv_centred",
         "vector_chunk_backward_centred", "vector_chunk_backward_exact", "vector_chunk_backward_runtime",
         "op_kda_fwd_centred", "op_kda_fwd_runtime", "op_kda_centred", "op_kda_runtime",
         "op_gdn2_fwd_centred", "op_gdn2_centred", "op_gdn_fwd", "op_gdn", "op_deltanet",
         "backward_passes_gdn", "op_gdn_k256", "op_deltanet_k256", "op_gdn_fwd_k256", "op_deltanet_fwd_k256",
         "op_deltanet_k64", "op_deltanet_fwd_k64")
__doc__ += "\n".join(f"    {c}" for c in CASES) + "\n"
__doc__ += """
The ``op_kda``, ``op_gdn2`` and ``op_gdn`` cases time the public op, ``chunk_kda`` /
``chunk_gdn2`` / ``chunk_gated_delta_rule(..., backend="mosaic_gpu")``: its forward (``_fwd``)
or o and every input's gradient (policy recompute), XLA's work around the kernels included
(what a kernel alone leaves out: the frame flags, a conditional, the gate sums, the leaf maps).
``_k256`` cases: the op at (4, 2048, 16, 256) instead of the anchor (K = 256: the blocked
per-chunk gradient kernel); ``_k64`` cases: at (8, 1024, 8, 64), FLA's D = 64 shape (DeltaNet's
R as a bf16 pair).
"""
AB_DIR = ".ab"


def prepare(commits: list[str]) -> None:
    """``.ab/<label>/{pallas_kernels,rewy_jax}`` for each commit (label = the commit as given)."""
    for c in commits:
        dst = os.path.join(AB_DIR, c.replace("/", "_"))
        shutil.rmtree(dst, ignore_errors=True)
        os.makedirs(dst)
        archive = subprocess.run(["git", "archive", c, "pallas_kernels", "rewy_jax"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", dst], input=archive, check=True)
        print(dst, flush=True)


def _inputs(shape, seed=0):
    """Random inputs of ``shape`` (bf16 tokens, gates in [−1, 0], β in [0, 1])."""
    import jax.numpy as jnp

    B, T, H, D = shape
    rng = np.random.default_rng(seed)
    bf = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.bfloat16)  # noqa: E731
    g = rng.uniform(-1, 0, (B, T, H, D))
    resets = g.copy()
    resets[rng.uniform(size=g.shape) < 0.01] = -np.inf
    return dict(shape=shape, bf=bf, q=bf(B, T, H, D), k=bf(B, T, H, D), v=bf(B, T, H, D),
                g=jnp.asarray(g, jnp.float32), g_resets=jnp.asarray(resets, jnp.float32),
                beta=jnp.asarray(rng.uniform(0, 1, (B, T, H)), jnp.float32),
                g_scalar=jnp.asarray(rng.uniform(-0.1, 0, (B, T, H)), jnp.float32))


def _vector(x, case, ip):
    """(chunk kernel callable, gradient kernel callable) for a vector case, or raise."""
    import jax

    from pallas_kernels.mosaic_gpu.vector_chunk import vector_chunk
    from pallas_kernels.mosaic_gpu.vector_chunk_backward import vector_chunk_backward
    from pallas_kernels.mosaic_gpu.vector_prep import prepare_vector

    mode = case.rsplit("_", 1)[1]
    bound = -5.0 if mode == "centred" else None
    g = x["g_resets"] if mode == "exact" else x["g"]
    pkw = dict(gate_lower_bound=bound)
    if "interpret" in inspect.signature(prepare_vector).parameters:  # trees whose gate sums are a Triton kernel
        pkw["interpret"] = ip is not None
    prep = jax.jit(lambda *a: prepare_vector(*a, **pkw))(x["q"], x["k"], x["v"], g, x["beta"])
    kw = dict(scale=0.08, centred=bound is not None, interpret=ip)
    runtime = "centred_chunks" in inspect.signature(vector_chunk).parameters
    if mode == "runtime" and not runtime:
        raise NotImplementedError("no per-chunk frames in this tree")
    prep = tuple(prep[:5]) + ((prep[5],) if runtime and bound is None else ())
    ckw = dict(kw, out_inverse=True) if "_inv_" in case else kw  # A's split pair out, as the backward needs
    chunk = jax.jit(lambda *a: vector_chunk(*a, **ckw))
    B, T, H, D = x["shape"]
    bf = x["bf"]
    q, k, _, g2, _ = prep[:5]
    args = [q, k, k, g2, bf(B, T, H, D), bf(B, T, H, D), bf(B, T, H, D), bf(B, H, T // 64, D, D),
            bf(B, H, T // 64, D, D), bf(B, H, T, 64), bf(B, H, T, 64)] + list(prep[5:])
    gkw = dict(kw)
    if "kda_leaf" in inspect.signature(vector_chunk_backward).parameters:  # trees that apply KDA's leaf maps there
        gkw["kda_leaf"] = (prep[4], prep[2])
    grad = jax.jit(lambda *a: vector_chunk_backward(*a, **gkw))
    return (lambda: chunk(*prep)), (lambda: grad(*args))


def _op(x, case, smoke):
    """A callable of the public KDA, GDN2 or GDN op for an ``op_`` case (see the module docstring)."""
    import jax
    import jax.numpy as jnp

    from rewy_jax.ops import chunk_delta_rule, chunk_gated_delta_rule, chunk_gdn2, chunk_kda

    mode = case.rsplit("_", 1)[1]
    bound = -5.0 if mode == "centred" else None
    g = x["g_resets"] if mode == "exact" else x["g"]
    kw = dict(backend="mosaic_gpu", gate_lower_bound=bound, interpret=smoke)
    if case.startswith("op_gdn_") or case == "op_gdn":  # scalar gates
        args = (x["q"], x["k"], x["v"], x["g_scalar"], x["beta"])
        op = lambda *a: chunk_gated_delta_rule(*a, backend="mosaic_gpu", interpret=smoke)[0]  # noqa: E731
    elif case.startswith("op_deltanet"):
        args = (x["q"], x["k"], x["v"], x["beta"])
        op = lambda *a: chunk_delta_rule(*a, backend="mosaic_gpu", interpret=smoke)[0]  # noqa: E731
    elif case.startswith("op_kda"):
        args = (x["q"], x["k"], x["v"], g, x["beta"])
        op = lambda *a: chunk_kda(*a, **kw)[0]  # noqa: E731
    else:  # GDN2: per-channel b and w in [0, 1]
        b = jnp.broadcast_to(x["beta"][..., None], g.shape)
        args = (x["q"], x["k"], x["v"], g, b, b)
        op = lambda *a: chunk_gdn2(*a, **kw)[0]  # noqa: E731
    if "_fwd" in case:
        f = jax.jit(op)
    else:
        do = x["bf"](*x["shape"])

        # o and its VJP, as benchmarks.run times them: the gradient of Σ o·dO alone lets XLA drop
        # the forward's o, which under policy "recompute" left only the backward to time
        def fwd_bwd(*a):
            o, vjp = jax.vjp(op, *a)
            return o, vjp(do.astype(o.dtype))
        f = jax.jit(fwd_bwd)
    return lambda: f(*args)


def _scalar_backward(x, prep, ip, smoke):
    """A callable of DeltaNet's per-chunk gradient kernel alone, on the states, Λ and dS that
    the forward and the reverse pass give for ``prep`` (api.prepare's q, k, v, T0, β)."""
    import jax

    from pallas_kernels.mosaic_gpu import config
    from pallas_kernels.mosaic_gpu.chunk_backward import chunk_backward
    from pallas_kernels.mosaic_gpu.forward import fused_forward
    from pallas_kernels.mosaic_gpu.state_backward import state_backward

    B, T, H, D = x["shape"]
    qp, kp, vp, t0, bh = prep
    # (smoke: the value-rows passes; the key-rows ones need 3 CPUs in the interpreter)
    cfg = config.default_config(D, D, 2, heads=None if smoke else B * H, gated=False)
    kw = dict(scale=D ** -0.5, interpret=ip)
    o, _, states = jax.jit(lambda *a: fused_forward(*a, None, cfg=cfg.forward, out_final=True, save_states=True,
                                                    **kw))(qp, kp, vp, t0, None, bh)
    lam, dst, _ = jax.jit(lambda *a: state_backward(*a, None, cfg=cfg.state_backward, **kw))(qp, kp, o, t0, None, bh)
    cb = jax.jit(lambda *a: chunk_backward(*a, cfg=cfg.chunk_backward, **kw))
    return lambda: cb(qp, kp, vp, o, lam, states, dst, t0, None, bh)


def _backward_passes(x, prep, ip, smoke):
    """A callable of GDN's recompute-policy backward passes (h0 = 0, no final-state cotangent),
    as the tree runs them: one launch of both where it has ``launch.py``, else the states-only
    forward, then the reverse state pass."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.mosaic_gpu import config
    from pallas_kernels.mosaic_gpu.forward import fused_forward

    B, T, H, D = x["shape"]
    qp, kp, vp, t0, g2, bh = prep
    do = x["bf"](B, T, H, D)
    h0 = jnp.zeros((B, H, D, D), jnp.float32)
    scale = D ** -0.5
    heads = None if smoke else B * H  # (smoke: value rows, as in the other cases)
    try:
        from pallas_kernels.mosaic_gpu.forward import forward_part
        from pallas_kernels.mosaic_gpu.launch import launch
        from pallas_kernels.mosaic_gpu.state_backward import state_backward_part
    except ImportError:  # two launches
        from pallas_kernels.mosaic_gpu.state_backward import state_backward

        cfg = config.default_config(D, D, 2, heads=heads, gated=True)

        def passes(qp, kp, vp, do, t0, g2, bh, h0):
            _, _, states = fused_forward(None, kp, vp, t0, g2, bh, h0, scale=scale, cfg=cfg.forward,
                                         out_final=False, save_states=True, interpret=ip, out_o=False)
            return states, state_backward(qp, kp, do, t0, g2, bh, None, scale=scale, cfg=cfg.state_backward,
                                          interpret=ip)
    else:
        cfg = config.default_config(D, D, 2, heads=heads, gated=True, policy="recompute")

        def passes(qp, kp, vp, do, t0, g2, bh, h0):
            rec = forward_part(None, kp, vp, t0, g2, bh, h0, scale=scale, cfg=cfg.recompute, out_final=False,
                               save_states=True, out_o=False)
            rev = state_backward_part(qp, kp, do, t0, g2, bh, None, scale=scale, cfg=cfg.state_backward)
            return launch([rec, rev], B, H, interpret=ip)
    f = jax.jit(passes)
    return lambda: f(qp, kp, vp, do, t0, g2, bh, h0)


def time_tree(cases: list[str], smoke: bool = False) -> dict:
    """Each case's ms (or its error) with the ``pallas_kernels`` on the path. ``smoke``: a small
    shape in the GPU interpreter, each case run once (the CPU check of this tool; times are 0)."""
    import functools

    import jax

    from benchmarks import mosaic_kernels
    from benchmarks.shapes import ANCHOR_SHAPE, Shape
    from pallas_kernels.mosaic_gpu import api, compat, config
    from pallas_kernels.mosaic_gpu.chunk_inverse import chunk_inverse
    from pallas_kernels.mosaic_gpu.forward import fused_forward
    from pallas_kernels.mosaic_gpu.state_backward import state_backward

    import pallas_kernels

    import rewy_jax

    for key, mod in (("kernels from", pallas_kernels), ("op from", rewy_jax)):
        print(json.dumps({key: os.path.dirname(os.path.dirname(mod.__file__))}), flush=True)
    x = _inputs(Shape(1, 128, 1, 64) if smoke else ANCHOR_SHAPE)
    ip = compat.interpret_params(True) if smoke else None
    time_ms = (lambda fn, loops=0: (jax.block_until_ready(fn()), 0.0)[1]) if smoke else mosaic_kernels.time_ms
    B, T, H, D = x["shape"]
    qp, kp, vp, t0, g2, bh = jax.jit(functools.partial(api.prepare, interpret=smoke))(
        x["q"], x["k"], x["v"], x["g_scalar"], x["beta"])
    out = {}
    for case in cases:
        try:
            if case == "t0":
                f = jax.jit(functools.partial(chunk_inverse, interpret=ip))
                out[case] = time_ms(lambda: f(kp, bh), loops=100)
            elif case.startswith(("forward_gdn", "state_backward_gdn")):
                # GDN's serial passes alone, in the layout the op picks at this shape (key rows at
                # the anchor) or in value rows (smoke: value rows; the key-rows reverse pass needs
                # 3 CPUs in the interpreter)
                value_rows = smoke or case.endswith("_value_rows")
                cfg = config.default_config(D, D, 2, heads=None if value_rows else B * H, gated=True)
                if case.startswith("forward"):  # the forward's state chain and output, h0 = 0
                    f = jax.jit(lambda *a: fused_forward(*a, None, scale=D ** -0.5, cfg=cfg.forward, out_final=False,
                                                         save_states=False, interpret=ip))
                    out[case] = time_ms(lambda: f(qp, kp, vp, t0, g2, bh))
                else:
                    f = jax.jit(lambda *a: state_backward(*a, None, scale=D ** -0.5, cfg=cfg.state_backward,
                                                          interpret=ip))
                    out[case] = time_ms(lambda: f(qp, kp, vp, t0, g2, bh))
            elif case == "backward_passes_gdn":
                out[case] = time_ms(_backward_passes(x, (qp, kp, vp, t0, g2, bh), ip, smoke))
            elif case == "chunk_backward_deltanet":  # DeltaNet's per-chunk gradient kernel (one warpgroup)
                out[case] = time_ms(_scalar_backward(x, (qp, kp, vp, t0, bh), ip, smoke))
            elif case.endswith(("_k256", "_k64")):
                base, k = case.rsplit("_k", 1)
                full = Shape(4, 2048, 16, 256) if k == "256" else Shape(8, 1024, 8, 64)
                xk = _inputs(Shape(1, 128, 1, int(k)) if smoke else full)
                out[case] = time_ms(_op(xk, base, smoke))
            elif case.startswith("op_"):
                out[case] = time_ms(_op(x, case, smoke))
            else:
                chunk, grad = _vector(x, case.replace("_backward", ""), ip)
                out[case] = time_ms(grad if "_backward" in case else chunk)
        except Exception as e:  # noqa: BLE001 - a tree without this case: report and go on
            out[case] = f"{type(e).__name__}"
        print(json.dumps({case: out[case]}), flush=True)
    return out


def run(cases: list[str], limit: int, smoke: bool = False, log_dir: str | None = None,
        trees: list[str] | None = None) -> dict:
    """Times ``cases`` for every tree under AB_DIR; prints and returns ``{tree: {case: ms | error}}``.
    ``log_dir``: each tree's stdout and stderr also go to ``<log_dir>/<tree>.log`` (e.g. the
    ptxas reports that ``MOSAIC_GPU_DUMP_PTXAS=1`` prints while compiling). ``trees``: these
    trees only (default: every tree under AB_DIR)."""
    trees = trees or sorted(d for d in os.listdir(AB_DIR) if os.path.isdir(os.path.join(AB_DIR, d)))
    results = {}
    for t in trees:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.abspath(os.path.join(AB_DIR, t)), os.getcwd(), os.environ.get("PYTHONPATH", "")]))
        try:
            # -P: the working directory does not go first on sys.path (the tree's kernels must)
            p = subprocess.run([sys.executable, "-P", "-m", "benchmarks.kernel_ab", "time", "--cases", ",".join(cases)]
                               + (["--smoke"] if smoke else []), env=env, capture_output=True, text=True,
                               timeout=limit)
            stdout, stderr = p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:  # keep the cases that finished
            as_text = lambda b: b.decode() if isinstance(b, bytes) else (b or "")  # noqa: E731
            stdout, stderr = as_text(e.stdout), as_text(e.stderr)
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
            with open(os.path.join(log_dir, f"{t}.log"), "w") as f:
                f.write(stdout + "\n--- stderr ---\n" + stderr)
        results[t] = {}
        for line in stdout.splitlines():
            if line.startswith("{"):
                results[t].update(json.loads(line))
        for key in ("kernels from", "op from"):
            where = results[t].pop(key, None)
            if where is not None and os.path.abspath(where) != os.path.abspath(os.path.join(AB_DIR, t)):
                raise RuntimeError(f"tree {t}: {key} {where}, not the tree")
        if not results[t]:  # the process failed before any case: show why
            print(t, "failed:", stderr[-600:], flush=True)
        print(t, results[t], flush=True)
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else (v or "-")  # noqa: E731
    print("\n| case (ms) | " + " | ".join(trees) + " |\n|---|" + "---|" * len(trees))
    for c in cases:
        print(f"| {c} | " + " | ".join(fmt(results[t].get(c)) for t in trees) + " |")
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("commits", nargs="+")
    for name in ("run", "time"):
        r = sub.add_parser(name)
        r.add_argument("--cases", default=",".join(CASES))
        r.add_argument("--limit", type=int, default=90, help="seconds per tree")
        r.add_argument("--smoke", action="store_true", help="small shape, GPU interpreter (CPU check)")
        if name == "run":
            r.add_argument("--log-dir", help="write each tree's stdout and stderr to <dir>/<tree>.log")
            r.add_argument("--trees", help="comma-separated trees under .ab (default: all)")
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        prepare(a.commits)
        return
    cases = a.cases.split(",")
    unknown = set(cases) - set(CASES)
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}; choose from {', '.join(CASES)}")
    if a.cmd == "time":
        time_tree(cases, a.smoke)
    else:
        run(cases, a.limit, a.smoke, a.log_dir, a.trees.split(",") if a.trees else None)


if __name__ == "__main__":
    main()
