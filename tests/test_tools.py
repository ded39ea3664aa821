"""The developer tools (``tools/``) against the kernel config: their variants are valid
KernelConfig overrides, their command-line settings parse to typed fields, and each runs end
to end on CPU (interpret mode or cross-lowering), building configs instead of changing any
module state."""

from __future__ import annotations

import contextlib
import gzip
import io
import json

import jax
import jax.numpy as jnp
import pytest

_ON_GPU = jax.default_backend() == "gpu"


def test_every_variant_is_a_valid_config():
    """Each VARIANTS entry applies to the default config of every gate mode and head dim, and
    changes it for some (unless it is the base or the declared-bound marker)."""
    from pallas_kernels.gpu import config
    from tools import profile_kernels as pk

    for name in pk.VARIANTS:
        changed = False
        for mode in config.GATE_MODES:
            for K in (64, 128, 256):
                d = config.default_config(mode, K, K, jnp.bfloat16)
                changed |= d.with_overrides(pk.variant_overrides(name)) != d
        assert changed == (name not in ("base", "centred")), name


def test_variants_combine_and_settings_parse():
    """variant_overrides("a+b"): two variants' overrides together (warps tables merged); a
    field or table entry set two ways is an error. parse_setting types a command line's
    "field=value" by the field."""
    from tools import profile_kernels as pk

    assert pk.variant_overrides("nopd+lw4+dl8") == {
        "fwd_predecayed": False, "warps": {"bwd_leaf": 4, "bwd_dlam": 8}}
    with pytest.raises(ValueError, match=r"warps\[bwd_dlam\]"):
        pk.variant_overrides("dl2+dl8")
    with pytest.raises(ValueError, match="block_k"):
        pk.variant_overrides("lk32+lk64")
    with pytest.raises(KeyError, match="nonesuch"):
        pk.variant_overrides("base+nonesuch")
    assert pk.is_bounded("nopd+centred") and not pk.is_bounded("nopd+lw4")
    assert pk.parse_setting("twin_pass=false") == ("twin_pass", False)
    assert pk.parse_setting("block_v=32") == ("block_v", 32)
    assert pk.parse_setting("backward_low_precision=S0,dS") == ("backward_low_precision",
                                                                 ("S0", "dS"))
    assert pk.parse_setting("backward_low_precision=,") == ("backward_low_precision", ())
    assert pk.parse_setting("leaf_diag=loop") == ("leaf_diag", "loop")
    assert pk.parse_setting("warps.bwd_leaf=4") == ("warps", {"bwd_leaf": 4})
    with pytest.raises(ValueError, match="unknown kernel setting 'exp2'"):
        pk.parse_setting("exp2=true")
    with pytest.raises(ValueError, match="a bool"):
        pk.parse_setting("twin_pass=1")


@pytest.mark.skipif(_ON_GPU, reason="interpret-mode smoke test")
def test_profile_script_runs_its_variants():
    """profile_kernels.profile runs every kernel of a variant in interpret mode; a variant that
    only reorganises work (the two state passes apart instead of the twin pass, which has its
    own row) agrees with the base one, a changed input does not."""
    from tools import profile_kernels

    rows, grads = profile_kernels.profile("scalar", "base", (1, 64, 1, 16), interpret=True,
                                          reps=1, runs=1)
    assert {"intra", "wu", "fwd_pass", "output", "bwd_local", "bwd_pass", "bwd_dlam",
            "bwd_leaf", "twin_pass", "OP_FWD+BWD (gdn)"} <= set(rows)
    assert all(t > 0 for t in rows.values())
    rows2, grads2 = profile_kernels.profile("scalar", "apart", (1, 64, 1, 16), interpret=True,
                                            reps=1, runs=1)
    assert "twin_pass" not in rows2
    assert profile_kernels.grad_gap(grads2, grads) < 1e-5
    assert profile_kernels.grad_gap(jax.tree_util.tree_map(lambda g: 2 * g, grads), grads) > 0.9


def test_trace_sums_stream_kernels(tmp_path):
    """trace_op.device_times on a GPU-like trace sums the stream threads only (the XLA-op
    spans repeat the same time); compare_table puts variants side by side; parse_plan reads
    a device call's plan."""
    from tools import trace_op

    ev = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
          {"ph": "M", "name": "thread_name", "pid": 1, "tid": 10, "args": {"name": "Stream #13"}},
          {"ph": "M", "name": "thread_name", "pid": 1, "tid": 11, "args": {"name": "XLA Ops"}},
          {"ph": "X", "pid": 1, "tid": 10, "name": "rewy_intra", "dur": 400.0},
          {"ph": "X", "pid": 1, "tid": 10, "name": "rewy_intra", "dur": 400.0},
          {"ph": "X", "pid": 1, "tid": 10, "name": "loop_fusion", "dur": 100.0},
          {"ph": "X", "pid": 1, "tid": 11, "name": "custom-call.1", "dur": 900.0},
          {"ph": "X", "pid": 2, "tid": 5, "name": "PjitFunction", "dur": 5000.0}]
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump({"traceEvents": ev}, fh)
    times, tracks = trace_op.device_times(str(path), iters=2)
    assert times == {"rewy_intra": 0.4, "loop_fusion": 0.05} and tracks == "Stream #13"
    table = trace_op.compare_table("gdn", (1, 64, 1, 16), {
        "base": {"rewy_wu": 0.1, "rewy_intra": 0.2, "fusion": 0.05, "WALL": 0.5},
        "nopd": {"rewy_wu": 0.07, "rewy_intra": 0.2, "WALL": 0.45}})
    assert "| rewy_wu | 0.1000 | 0.0700 |" in table
    assert "| our kernels | 0.3000 | 0.2700 |" in table
    assert "| XLA glue | 0.0500 | 0.0000 |" in table and "| wall per call | 0.5000 | 0.4500 |" in table
    assert trace_op.is_ours("vector_chunk_body_mosaic_gpu_kernel") and trace_op.is_ours("rewy_wu")
    assert not trace_op.is_ours("loop_select_fusion")
    assert trace_op.parse_plan("gdn,kda", "a,b") == [("gdn", ["a", "b"]), ("kda", ["a", "b"])]
    assert trace_op.parse_plan("x", "deltanet:a,b kda:c") == [("deltanet", ["a", "b"]),
                                                                ("kda", ["c"])]
    with pytest.raises(ValueError, match="OP:VARIANT"):
        trace_op.parse_plan("x", "deltanet: kda:c")


def test_fusion_sources_names_each_fusion():
    """trace_op.fusion_sources: each XLA fusion of a compiled module gets its result shape, its
    opcodes and the Python line it came from (this file's), multi-output fusions included."""
    import inspect

    import jax
    import jax.numpy as jnp

    from tools import trace_op

    line = inspect.currentframe().f_lineno + 1
    f = jax.jit(lambda a, b: ((a * b).astype(jnp.bfloat16), jnp.sum(a * 2.0, axis=0)))
    x = jnp.ones((64, 32), jnp.float32)
    text = f.lower(x, x).compile().as_text()
    found = trace_op.fusion_sources(text)
    converts = [v for v in found.values() if "convert" in v]
    assert converts and all(f"test_tools.py:{line}" in v for v in converts), found
    assert any(v.startswith("bf16[64,32] = multiply, convert") or "bf16[64,32]" in v for v in converts), found
    assert trace_op.fusion_sources("no module") == {}


@pytest.mark.skipif(_ON_GPU, reason="CPU check of the lowering tool")
def test_resource_report_plan_records_each_kernels_launch(tmp_path):
    """resource_report.plan: every (op, variant) of a device plan lowered for CUDA on CPU, each
    kernel's Triton IR written with the warps and stages it launches with — the config's —;
    each variant's overrides reach its own lowering (unfused: the output kernel); a variant
    that cannot lower is reported; the jax patches are undone."""
    from pallas_kernels.gpu import api, config
    from tools import resource_report

    supports = api.supports
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        resource_report.plan(str(tmp_path), "deltanet:base,unfused,nonesuch", "1x128x2x32")
    assert "deltanet nonesuch LOWERING FAILED KeyError" in log.getvalue()
    launches = json.loads((tmp_path / "launches.json").read_text())
    files = {p.name for p in tmp_path.glob("*.ttir")}
    assert files == set(launches) and files
    d = config.default_config("none", 32, 32, jnp.bfloat16)
    assert launches["deltanet__base__rewy_bwd_leaf__1.ttir"][0] == d.warp("bwd_leaf")
    assert launches["deltanet__base__rewy_intra__1.ttir"][0] == d.warp("intra")
    assert ("deltanet__unfused__rewy_output__1.ttir" in files
            and not any("base__rewy_output" in f for f in files))
    assert api.supports is supports
