"""The benchmark's accuracy check of the Mosaic GPU scalar-gate kernels, in the GPU interpreter (CPU).

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu NPROC=4 python tools/mosaic_accuracy_repro.py deltanet 8 64 [--policy recompute]

Same inputs (benchmarks.inputs.accuracy_inputs, seed 0), cotangents and float64 reference
(benchmarks.reference_job, cached under /tmp) and ratios as benchmarks/accuracy.py at the accuracy
shape (1, T, H, D); ours through ``backend="mosaic_gpu"`` with the interpreter.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time
from pathlib import Path

import numpy as np


def reference(op, H, D, T):
    from benchmarks.shapes import Shape
    from benchmarks import inputs as binputs
    shape = Shape(1, T, H, D)
    cache = Path(f"/tmp/mosaic_acc_ref_{op}_{T}_{H}_{D}.npz")
    inp = binputs.accuracy_inputs(op, 1, T, H, D, seed=0)
    cts = binputs.accuracy_cotangents(inp, seed=1)
    if not cache.exists():
        from benchmarks.interpret_accuracy import reference as ref_job
        _, _, ref = ref_job(op, shape)
        np.savez(cache, **ref)
    with np.load(cache) as d:
        ref = {n: d[n] for n in d.files}
    return inp, cts, ref


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("op")
    ap.add_argument("H", type=int)
    ap.add_argument("D", type=int)
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--policy", default="recompute")
    ap.add_argument("--fwd-only", action="store_true")
    ap.add_argument("--value-rows", action="store_true",
                    help="the serial passes in the value-rows layout (as for a grid over one wave)")
    ap.add_argument("--split-r", choices=("rule", "on", "off"), default="rule",
                    help="PassConfig.split_r: config.split_r_for's rule, or forced")
    a = ap.parse_args(argv)
    from pallas_kernels.mosaic_gpu import config

    default = config.default_config

    def patched(*args, **kw):
        if a.value_rows:
            kw["heads"] = None
        cfg = default(*args, **kw)
        if a.split_r != "rule":
            on = a.split_r == "on"
            cfg = dataclasses.replace(cfg, forward=dataclasses.replace(cfg.forward, split_r=on),
                                      recompute=dataclasses.replace(cfg.recompute, split_r=on))
        return cfg

    config.default_config = patched
    import jax
    import jax.numpy as jnp
    from benchmarks import accuracy
    from benchmarks.impls import Ours
    from rewy_jax import testing

    class OursInterpret(Ours):
        def kwargs(self, op):
            return dict(super().kwargs(op), interpret=True)

    inp, cts, ref = reference(a.op, a.H, a.D, a.T)
    impl = OursInterpret("mosaic_gpu", "rewy", a.policy)
    t0 = time.time()
    if a.fwd_only:
        i, _ = accuracy._jax_args(inp, cts)
        spec = testing.OPS[a.op]
        o, s = jax.jit(lambda i: impl.call(a.op, i["q"], i["k"], i["v"], i, True))(i)
        rep = accuracy.compare(np.asarray(o.astype(jnp.float32)), np.asarray(s, np.float32), {}, ref)
    else:
        rep = accuracy.compare(*accuracy.run_impl(impl, a.op, inp, cts), ref)
    tag = f"split_r={a.split_r}" + (" value rows" if a.value_rows else "")
    print(f"{a.op} (1, {a.T}, {a.H}, {a.D}) {a.policy} [{tag}]: {rep['status']} " + " ".join(
        f"{n}={r:.2e}/{t:.0e}" for n, (r, t) in rep["ratios"].items()) + f"  ({time.time() - t0:.0f} s)",
        flush=True)


if __name__ == "__main__":
    main()
