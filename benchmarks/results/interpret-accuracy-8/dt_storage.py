"""dT and dA_qk stored in bf16 or fp32 (backward.low_precision "dT"), everything else at the
defaults: the benchmark's inputs, float64 reference and thresholds at (1, 512, H, D), our kernels
through the Pallas interpreter (CPU).

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/results/interpret-accuracy-8/dt_storage.py deltanet 8 64
"""
import sys

from benchmarks import accuracy
from benchmarks.interpret_accuracy import OursInterpret, reference
from benchmarks.shapes import Shape
from pallas_kernels.gpu import kernels

op, H, D = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
inp, cts, ref = reference(op, Shape(1, 512, H, D))
impl = OursInterpret("pallas_gpu", "rewy", "recompute")
without = tuple(n for n in kernels.DEFAULTS["backward.low_precision"] if n != "dT")
for name, names in (("dT fp32", without), ("dT bf16", without + ("dT",))):
    kernels.TUNE["backward.low_precision"] = names
    rep = accuracy.compare(*accuracy.run_impl(impl, op, inp, cts), ref)
    print(op, H, D, name, rep["status"],
          " ".join(f"{n}={r:.2e}/{t:.0e}" for n, (r, t) in rep["ratios"].items()), flush=True)
