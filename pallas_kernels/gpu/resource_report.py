"""Registers, spills and shared memory of the Pallas GPU kernels, without a GPU (no device time).

Two steps, because the lowering needs jax and the compile needs the Triton of the GPU machine
(triton 3.6, for Python 3.12 — the lent H200's version):

    # 1. lower the kernels of one op (fwd + bwd, bf16, B=2 T=4096 H=16) to Triton IR files
    JAX_PLATFORMS=cpu PYTHONPATH=$PWD python pallas_kernels/gpu/resource_report.py dump kda /tmp/ttir [K=128] [backward=wy] [dtype=float32] [policy=save]
        [gate_lower_bound=-5] [tune.rewy_bwd_leaf.exact_diag=loop] [tune.rewy_bwd_leaf.rowgrid=false]
        [tune.backward.low_precision=S0,R,dS,dR,dRl,lam]
    # 2. compile them for sm_90 and print ptxas's report (in a venv with `pip install triton==3.6.0`)
    python pallas_kernels/gpu/resource_report.py ptxas /tmp/ttir/*.ttir [--warps 8] [--stages 3]

Step 2 reports per kernel: shared memory (must stay under ~227 KB on Hopper), registers per
thread and spill bytes. Pass the same --warps/--stages the kernels use (kernels.WARPS,
kernels._pass_stages — 2 at K ≤ 128 for the calls without cu_seqlens that the dump makes):
the Triton IR does not carry them. The GPU model is forced to H200 for the lowering (a
lowering-only shortcut through jax internals; never used by the library).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import warnings


def dump(op, outdir, *opts):
    warnings.simplefilter("ignore")
    import jax
    import jax.numpy as jnp
    from jax._src.pallas.triton import gpu_info
    from jax._src.pallas.triton import pallas_call_registration as pcr

    from pallas_kernels.gpu import api
    from rewy_jax import testing

    pcr.gpu_info_lib.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    orig = pcr.lowering.lower_jaxpr_to_triton_module
    seen = {}

    def capture(*a, **k):
        res = orig(*a, **k)
        asm = res.module.operation.get_asm(enable_debug_info=False)
        name = re.search(r"tt.func (?:public )?@(\w+)", asm).group(1)
        seen[name] = seen.get(name, 0) + 1
        with open(os.path.join(outdir, f"{op}__{name}__{seen[name]}.ttir"), "w") as f:
            f.write(asm)
        return res

    pcr.lowering.lower_jaxpr_to_triton_module = capture
    api.supports = lambda *a: None  # lowering only: the CPU is not a CUDA device
    kw = dict(o.split("=", 1) for o in opts)
    K = int(kw.pop("K", 128))
    from pallas_kernels.gpu import kernels
    for key in [k for k in kw if k.startswith("tune.")]:  # tune.rewy_bwd_leaf.rowgrid=false, ...
        name, value = kernels.parse_tune(f"{key[5:]}={kw.pop(key)}")
        kernels.TUNE[name] = value
    if "gate_lower_bound" in kw:
        kw["gate_lower_bound"] = float(kw["gate_lower_bound"])
    os.makedirs(outdir, exist_ok=True)
    dtype = jnp.dtype(kw.pop("dtype", "bfloat16"))  # dtype=float32: the fp32-input kernels
    inp = testing.make_inputs(op, 2, 4096, 16, K, K, dtype=dtype, initial_state=False)
    names = list(inp)
    args = [inp[n] for n in names]

    def run(*xs):
        return testing.run_op(op, dict(zip(names, xs)), backend="pallas_gpu", use_qk_l2norm=True, **kw)

    def loss(*xs):
        return jnp.sum(run(*xs)[0].astype(jnp.float32))

    for f in (run, jax.grad(loss, argnums=tuple(range(len(names))))):
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
    print(op, seen)


def _sass_counts(cubin, ptxas_exe):
    """Static SASS instruction count (all, and tensor-core HMMA/HGMMA) of a cubin, by the
    cuobjdump that ships beside Triton's ptxas: a proxy for issue-bound kernels' work."""
    dump = os.path.join(os.path.dirname(ptxas_exe), "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    r = subprocess.run([dump, "-sass", f.name], capture_output=True, text=True, check=False)
    ins = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([A-Z][A-Z0-9_.]*)", r.stdout)
    mma = sum(1 for i in ins if i.startswith(("HMMA", "HGMMA")))
    return f"sass {len(ins)} (mma {mma})"


def ptxas(paths, warps=8, stages=3):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    p = get_ptxas(90)
    exe = getattr(p, "path", p)
    for path in paths:
        try:
            k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": warps, "num_stages": stages})
            with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                f.write(k.asm["ptx"])
            r = subprocess.run([exe, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                               capture_output=True, text=True, check=False)
            info = " ".join(line.split("info    :")[-1].strip() for line in r.stderr.splitlines()
                            if "Used" in line or "spill" in line)
            print(f"{os.path.basename(path):45s} shared={k.metadata.shared:7d} | {info} | "
                  f"{_sass_counts(k.asm['cubin'], exe)}")
        except Exception as ex:  # noqa: BLE001 — report every kernel
            print(os.path.basename(path), "FAILED", type(ex).__name__, str(ex)[:300])


if __name__ == "__main__":
    if sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3], *sys.argv[4:])
    else:
        args = sys.argv[2:]
        w = int(args[args.index("--warps") + 1]) if "--warps" in args else 8
        st = int(args[args.index("--stages") + 1]) if "--stages" in args else 3
        ptxas([a for a in args if a.endswith(".ttir")], w, st)
