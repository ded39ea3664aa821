"""Registers, spills and shared memory of the Pallas GPU kernels, without a GPU (no device time).

Two steps, because the lowering needs jax and the compile needs the Triton of the GPU machine
(triton 3.6, for Python 3.12 — the lent H200's version):

    # 1. lower the kernels of one op (fwd + bwd, bf16, B=2 T=4096 H=16) to Triton IR files
    JAX_PLATFORMS=cpu python -m tools.resource_report dump kda /tmp/ttir [K=128] [backward=wy]
        [dtype=float32] [policy=save] [gate_lower_bound=-5] [cfg.leaf_diag=loop]
        [cfg.leaf_rowgrid=false] [cfg.backward_low_precision=S0,R,dS,dR,dRl,lam]
        [cfg.warps.bwd_leaf=4]
    #    or every (op, variant) of a device plan (trace_op.py's --variants forms; vector-gate
    #    ops with g >= -5 declared), to check before a device call that each lowers and compiles
    JAX_PLATFORMS=cpu python -m tools.resource_report plan /tmp/ttir \
        "deltanet:base,apart kda:centred,nopd" [2x4096x16x128]
    # 2. compile them for sm_90 and print ptxas's report (in a venv with `pip install triton==3.6.0`)
    python tools/resource_report.py ptxas /tmp/ttir/*.ttir [--warps 8] [--stages 3]

Step 1 also writes ``launches.json`` beside the files: each kernel's warps and pipeline stages
as the kernels launch it (read from the lowered custom call), which step 2 uses for every file
it lists unless ``--warps`` / ``--stages`` override them (the Triton IR does not carry them).
Step 2 reports per kernel: shared memory (~227 KB per SM on Hopper; jaxlib's Triton has run
kernels this Triton counts a little over it, docs/performance-log.md), registers per thread, spill bytes and
static SASS counts; a kernel that fails to compile says FAILED. The GPU model is forced to H200
for the lowering (a lowering-only shortcut through jax internals; never used by the library).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings

LAUNCHES = "launches.json"


@contextlib.contextmanager
def _capturing(outdir):
    """Within: the Pallas Triton lowering writes every kernel it lowers to ``outdir`` as
    ``<prefix[0]>__<kernel>__<n>.ttir``, with its warps and stages in ``outdir/launches.json``;
    yields the one-element prefix list to set between lowerings. The patched jax internals and
    ``api.supports`` are restored after.

    The one place of the repository that imports jax's private modules: the Triton IR of a
    kernel and its launch settings exist only inside the Pallas Triton lowering (no public API
    returns them), and the GPU model it targets must be forced to H200 on a CPU machine."""
    from jax._src.pallas.triton import pallas_call_registration as pcr

    # The lowering's own GPU-model module (jax._src.pallas.triton.gpu_info up to jax 0.12.0,
    # jax._src.gpu_info from 0.12.1): taken from the module that uses it, so both work.
    gpu_info = pcr.gpu_info_lib

    from pallas_kernels.gpu import api

    saved = (pcr.gpu_info_lib.get_gpu_info, api.supports, pcr.lowering.lower_jaxpr_to_triton_module,
             pcr.mlir.custom_call)
    pcr.gpu_info_lib.get_gpu_info = lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    api.supports = lambda *a: None  # lowering only: the CPU is not a CUDA device
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, LAUNCHES)
    launches = json.load(open(path)) if os.path.exists(path) else {}
    prefix, pending, seen = [""], [], {}
    lower, custom_call = pcr.lowering.lower_jaxpr_to_triton_module, pcr.mlir.custom_call

    def capture_module(*a, **k):
        res = lower(*a, **k)
        pending.append(res.module.operation.get_asm(enable_debug_info=False))
        return res

    def capture_launch(*a, backend_config=None, **k):  # follows its module's lowering
        if backend_config is not None and "num_warps" in backend_config:
            asm = pending.pop()
            name = re.search(r"tt.func (?:public )?@(\w+)", asm).group(1)
            key = (prefix[0], name)
            seen[key] = seen.get(key, 0) + 1
            fname = f"{prefix[0]}__{name}__{seen[key]}.ttir"
            with open(os.path.join(outdir, fname), "w") as f:
                f.write(asm)
            launches[fname] = [int(str(backend_config[n]).split(":")[0])
                               for n in ("num_warps", "num_stages")]
            with open(path, "w") as f:
                json.dump(launches, f, sort_keys=True)
        return custom_call(*a, backend_config=backend_config, **k)

    pcr.lowering.lower_jaxpr_to_triton_module = capture_module
    pcr.mlir.custom_call = capture_launch
    try:
        yield prefix
    finally:
        (pcr.gpu_info_lib.get_gpu_info, api.supports, pcr.lowering.lower_jaxpr_to_triton_module,
         pcr.mlir.custom_call) = saved


def _lower_op(op, B, T, H, K, dtype, **kw):  # kw: the op's keywords (kernel_config= too)
    """Lower the public op's forward and its fwd+bwd (o and its VJP) for CUDA."""
    import jax
    import jax.numpy as jnp

    from rewy_jax import testing

    inp = testing.make_inputs(op, B, T, H, K, K, dtype=dtype, initial_state=False)
    run = lambda x: testing.run_op(op, x, backend="pallas_gpu", use_qk_l2norm=True, **kw)[0]  # noqa: E731
    dO = jnp.zeros(inp["v"].shape, dtype)
    for f in (run, lambda x: testing.output_and_vjp(run, x, dO)):
        jax.jit(f).trace(inp).lower(lowering_platforms=("cuda",))


def dump(op, outdir, *opts):
    warnings.simplefilter("ignore")
    import jax.numpy as jnp

    kw = dict(o.split("=", 1) for o in opts)
    K = int(kw.pop("K", 128))
    from tools.profile_kernels import parse_setting

    overrides = {}
    for key in [k for k in kw if k.startswith("cfg.")]:  # cfg.leaf_rowgrid=false, ...
        name, value = parse_setting(f"{key[4:]}={kw.pop(key)}")
        if isinstance(value, dict):  # warps.<kernel> / stages.<pass>
            value = {**overrides.get(name, {}), **value}
        overrides[name] = value
    if overrides:
        kw["kernel_config"] = overrides
    if "gate_lower_bound" in kw:
        kw["gate_lower_bound"] = float(kw["gate_lower_bound"])
    dtype = jnp.dtype(kw.pop("dtype", "bfloat16"))  # dtype=float32: the fp32-input kernels
    with _capturing(outdir) as prefix:
        prefix[0] = op
        _lower_op(op, 2, 4096, 16, K, dtype, **kw)
    print(op, "->", outdir)


def plan(outdir, variants, shape="2x4096x16x128"):
    """Every (op, variant) of a trace plan, lowered under its settings (trace_op's forms)."""
    warnings.simplefilter("ignore")
    import jax.numpy as jnp

    from tools import profile_kernels, trace_op

    B, T, H, K = (int(x) for x in shape.split("x"))
    with _capturing(outdir) as prefix:
        for op, names in trace_op.parse_plan("", variants):
            for var in names:
                prefix[0] = f"{op}__{var}"
                kw = {"gate_lower_bound": -5.0} if op in ("kda", "gdn2") else {}
                try:
                    _lower_op(op, B, T, H, K, jnp.bfloat16,
                              kernel_config=profile_kernels.variant_overrides(var), **kw)
                    print(op, var, "lowered", flush=True)
                except Exception as ex:  # noqa: BLE001 — report every variant
                    print(op, var, "LOWERING FAILED", type(ex).__name__, str(ex)[:300],
                          flush=True)


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


def ptxas(paths, warps=None, stages=None):
    """ptxas's report per Triton IR file, each compiled with its own launch settings from the
    ``launches.json`` beside it (``warps`` / ``stages`` override them; 4 and 2 without either)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas

    p = get_ptxas(90)
    exe = getattr(p, "path", p)
    known = {}
    for path in paths:
        index = os.path.join(os.path.dirname(path) or ".", LAUNCHES)
        if index not in known:
            known[index] = json.load(open(index)) if os.path.exists(index) else {}
        w, st = known[index].get(os.path.basename(path), (4, 2))
        w, st = warps or w, stages or st
        try:
            k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": w, "num_stages": st})
            with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                f.write(k.asm["ptx"])
            r = subprocess.run([exe, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                               capture_output=True, text=True, check=False)
            info = " ".join(line.split("info    :")[-1].strip() for line in r.stderr.splitlines()
                            if "Used" in line or "spill" in line)
            print(f"{os.path.basename(path):45s} w{w} s{st} shared={k.metadata.shared:7d} | "
                  f"{info} | {_sass_counts(k.asm['cubin'], exe)}", flush=True)
        except Exception as ex:  # noqa: BLE001 — report every kernel
            print(os.path.basename(path), "FAILED", type(ex).__name__, str(ex)[:300], flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "dump":
        dump(sys.argv[2], sys.argv[3], *sys.argv[4:])
    elif sys.argv[1] == "plan":
        plan(*sys.argv[2:5])
    else:
        args = sys.argv[2:]
        w = int(args[args.index("--warps") + 1]) if "--warps" in args else None
        st = int(args[args.index("--stages") + 1]) if "--stages" in args else None
        ptxas([a for a in args if a.endswith(".ttir")], w, st)
