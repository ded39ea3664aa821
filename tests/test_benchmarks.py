"""CPU tests of the benchmark harness (benchmarks/): inputs, roofline, accuracy check, tables,
plot and merging, on a tiny shape with the XLA backend. Peers are absent (or GPU-only) here and
must be skipped with a reason."""

from __future__ import annotations

import copy
import json
import os
import time

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import accuracy, inputs, roofline, shapes

TINY = "1x64x2x16"


def test_device_inputs_match_protocol():
    for op in ("gdn", "gdn2"):  # between them: scalar and vector decays, β, b, w
        x = inputs.device_inputs(op, 1, 64, 2, 16, seed=3)
        assert set(x) == {"q", "k", "v", *inputs.gate_names(op)}
        for n in ("q", "k", "v"):
            assert x[n].dtype == jnp.bfloat16 and x[n].shape == (1, 64, 2, 16)
        for n in ("q", "k"):
            norms = np.linalg.norm(np.asarray(x[n], np.float32), axis=-1)
            np.testing.assert_allclose(norms, 1.0, atol=2e-2)
        for n in inputs.gate_names(op):
            g = np.asarray(x[n])
            assert x[n].dtype == jnp.float32 and np.all(np.isfinite(g))
            assert (g <= 0).all() if n == "g" else ((g >= 0) & (g <= 2)).all()
        assert x.get("g", jnp.zeros(1)).ndim in (1, 3, 4)
    # a different seed gives different data (inputs are rotated between timed calls)
    a, b = inputs.device_inputs("gdn", 1, 64, 2, 16, seed=1), inputs.device_inputs("gdn", 1, 64, 2, 16, seed=2)
    assert not np.array_equal(np.asarray(a["q"]), np.asarray(b["q"]))


def test_accuracy_inputs_are_bf16_values():
    x = inputs.accuracy_inputs("gdn2", 1, 64, 2, 16)
    assert "initial_state" not in x
    for n in ("q", "k", "v"):
        np.testing.assert_array_equal(x[n], np.asarray(jnp.asarray(x[n], jnp.bfloat16), np.float32))
    cts = inputs.accuracy_cotangents(x)
    assert cts["o"].shape == x["v"].shape and cts["final_state"].shape == (1, 2, 16, 16)


def test_roofline_matches_anchor_counts():
    # anchors.md: DeltaNet (2, 4096, 16, 128): ~22 GFLOP forward, >= 134 MB moved by the forward.
    fl = roofline.flops("deltanet", 2, 4096, 16, 128, 128)
    by = roofline.bytes_moved("deltanet", 2, 4096, 16, 128, 128)
    assert 20e9 < fl["fwd"] < 26e9 and fl["fwdbwd"] == pytest.approx(3 * fl["fwd"])
    assert by["fwd"] == pytest.approx(134.2e6 + 2 * 4096 * 16 * 4, rel=1e-3)
    assert roofline.bytes_moved("gdn2", 1, 64, 2, 16, 16)["fwd"] > roofline.bytes_moved("kda", 1, 64, 2, 16, 16)["fwd"]
    f = roofline.floor_ms("deltanet", shapes.ANCHOR_SHAPE, {"matmul_tflops": 780, "copy_tbps": 4.3})
    assert 0.02 < f["fwd"]["ms"] < 0.05 and f["fwdbwd"]["ms"] > f["fwd"]["ms"]


def test_compare_flags_failures():
    rng = np.random.default_rng(0)
    ref = {n: rng.standard_normal((4, 8)) for n in ("o", "final_state", "dq", "dbeta")}
    good = {n: v * (1 + 1e-4) for n, v in ref.items()}
    res = accuracy.compare(good["o"], good["final_state"], {"dq": good["dq"], "dbeta": good["dbeta"]}, ref)
    assert res["status"] == "pass" and set(res["ratios"]) == set(ref)
    bad = dict(good, dq=good["dq"] + 0.1 * rng.standard_normal((4, 8)))
    res = accuracy.compare(bad["o"], bad["final_state"], {"dq": bad["dq"], "dbeta": bad["dbeta"]}, ref)
    assert res["status"] == "FAIL" and res["failed"] == ["dq"]
    nan = dict(good, o=good["o"] * np.nan)
    res = accuracy.compare(nan["o"], nan["final_state"], {"error": "RuntimeError: refused"}, ref)
    assert res["status"] == "FAIL" and "o" in res["failed"]
    res = accuracy.compare(good["o"], good["final_state"], {"error": "RuntimeError: refused"}, ref)
    assert res["status"] == "fwd pass, bwd refused"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One end-to-end --cpu-smoke run: ours (XLA), the autodiff baseline, the peers (skipped)."""
    from benchmarks import run

    out = tmp_path_factory.mktemp("bench")
    rc = run.main(["--cpu-smoke", "--shapes", TINY, "--ops", "gdn", "--rounds", "2", "--sets", "2",
                   "--impls", "xla rewy/recompute,jla mosaic,FLA", "--out-dir", str(out),
                   "--stem", "smoke", "--gpu-lock", str(out / "gpu.lock")])  # the lock's
    assert rc == 0  # shared (set-up, accuracy) and exclusive (timing) turns, never nested
    return out, json.loads((out / "smoke.json").read_text())


def test_stopped_run_keeps_its_timings(tmp_path, monkeypatch):
    """A benchmark process that gpu_run.sh stops (SIGTERM past BENCH_TIMEOUT) during the
    accuracy check exits through SystemExit and still writes the rows it timed, and the
    process's SIGTERM handler is restored after."""
    import signal

    from benchmarks import run

    def stop(*a, **k):  # what `timeout` does to the process, here mid-check
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this returns
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(run, "check_accuracy", stop)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exc:
        run.main(["--cpu-smoke", "--shapes", TINY, "--ops", "gdn", "--rounds", "1", "--sets", "1",
                  "--impls", "xla rewy/recompute", "--out-dir", str(tmp_path), "--stem", "stopped",
                  "--gpu-lock", str(tmp_path / "gpu.lock")])
    assert exc.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
    rows = json.loads((tmp_path / "stopped.json").read_text())["rows"]
    ours = [r for r in rows if r["impl"] == "ours xla rewy/recompute"]
    assert ours and ours[0]["status"] == "ok" and ours[0]["ms"]["fwdbwd"] > 0
    assert "accuracy" not in ours[0]  # stopped before it was checked
    assert (tmp_path / "stopped.md").exists()


def test_accuracy_first_keeps_accuracy_of_a_run_stopped_while_timing(tmp_path, monkeypatch):
    """--accuracy-first checks accuracy before timing: a process stopped (SIGTERM) in the timing
    of its group still writes that group's accuracy (the GPU runs whose compile outlasted the
    call never reached the accuracy step)."""
    import signal

    from benchmarks import run

    def stop(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(run, "run_group", stop)
    with pytest.raises(SystemExit):
        run.main(["--cpu-smoke", "--shapes", TINY, "--ops", "gdn", "--rounds", "1", "--sets", "1",
                  "--impls", "xla rewy/recompute", "--out-dir", str(tmp_path), "--stem", "acc",
                  "--accuracy-first"])
    rows = {r["impl"]: r for r in json.loads((tmp_path / "acc.json").read_text())["rows"]}
    ours = rows["ours xla rewy/recompute"]
    assert ours["status"] == "skipped" and "stopped before timing" in ours["reason"]  # nothing was timed
    assert ours["accuracy"]["status"] == "pass", ours
    assert {"o", "dq", "dk", "dv", "dg", "dbeta"} <= set(ours["accuracy"]["ratios"])


def test_smoke_run_times_and_checks(smoke):
    out, res = smoke
    rows = {r["impl"]: r for r in res["rows"]}
    ours = rows["ours xla rewy/recompute"]
    assert ours["status"] == "ok"
    assert ours["ms"]["fwd"] > 0 and ours["ms"]["fwdbwd"] > 0
    assert ours["ms"]["bwd"] == pytest.approx(ours["ms"]["fwdbwd"] - ours["ms"]["fwd"])
    assert ours["accuracy"]["status"] == "pass", ours["accuracy"]
    assert {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta"} <= set(ours["accuracy"]["ratios"])
    assert ours["floor"]["fwdbwd"]["ms"] > 0 and ours["pct_of_floor"]["fwdbwd"] > 0
    # peers: skipped cleanly, with the reason
    for name in ("FLA eager", "FLA graph", "jla mosaic_gpu"):
        assert rows[name]["status"] == "skipped" and rows[name]["reason"], rows[name]
    meta = res["meta"]
    assert meta["command"].startswith("python -m benchmarks.run") and meta["date"] and meta["versions"]["jax"]
    md = (out / "smoke.md").read_text()
    assert "ours xla rewy/recompute" in md and "skipped" in md and meta["date"] in md
    assert "* JAX fwd+bwd timed as: o and its VJP for dO" in md
    assert (out / "smoke.png").stat().st_size > 1000


def test_merge_keeps_newest_rows_and_own_ratios(smoke, tmp_path):
    res = copy.deepcopy(smoke[1])
    newer = copy.deepcopy(res)
    rid = "newer000"
    newer["runs"] = {rid: {"date": "later", "command": "python -m benchmarks.run --ops gdn",
                           "triton": "3.7.1"}}
    newer["meta"]["command"] = "python -m benchmarks.run --ops gdn"
    # a part under another Triton (gpu_run.sh's newer one for FLA's GDN): both are named
    old_triton = res["meta"]["versions"].get("triton", "absent")
    res["meta"]["versions"]["triton"] = old_triton
    newer["meta"]["versions"]["triton"] = "3.7.1"
    for r in newer["rows"]:
        r["run_id"] = rid
    # the newer run measured only a new implementation "X" (ours skipped there)
    for r in newer["rows"]:
        if r["impl"] == "ours xla rewy/recompute":
            x = copy.deepcopy(r)
            r.update(status="skipped", reason="--impls")
            r.pop("ms", None)
    x.update(impl="X", ms={"fwd": 1.0, "fwdbwd": 3.0}, run_id=rid)
    newer["rows"].append(x)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(res))
    b.write_text(json.dumps(newer))
    from benchmarks import merge

    assert merge.main([str(a), str(b), "--out-dir", str(tmp_path), "--stem", "m"]) == 0
    m = json.loads((tmp_path / "m.json").read_text())
    rows = {r["impl"]: r for r in m["rows"]}
    assert rows["ours xla rewy/recompute"]["status"] == "ok"  # a skip does not replace a measurement
    assert rows["ours xla rewy/recompute"]["run_id"] == res["meta"]["run_id"]
    assert rows["X"]["ms"]["fwdbwd"] == 3.0 and rows["X"]["ms"]["bwd"] == 2.0
    assert len(m["meta"]["merged_from"]) == 2 and len(m["runs"]) == 2
    assert (tmp_path / "m.md").exists() and (tmp_path / "m.png").exists()
    assert "merged from" in (tmp_path / "m.md").read_text()
    assert m["meta"]["versions"]["triton"] == f"{old_triton} / 3.7.1"
    assert m["meta"]["versions"]["jax"] == res["meta"]["versions"]["jax"]  # one value: as is
    # each run names its Triton and how it timed the JAX fwd+bwd (runs from before that field
    # timed value_and_grad of Σ o·dO)
    md = (tmp_path / "m.md").read_text()
    assert "(triton 3.7.1; JAX fwd+bwd: value_and_grad of Σ o·dO)" in md
    assert "JAX fwd+bwd: o and its VJP for dO)" in md


def test_shape_parsing_and_accuracy_shape():
    s = shapes.parse_shape("(8,2048,32,256)")
    assert s == shapes.Shape(8, 2048, 32, 256) and s.key() == "8x2048x32x256"
    assert shapes.accuracy_shape(s) == shapes.Shape(1, 512, 32, 256)
    assert shapes.parse_shape(TINY).K == 16
    assert shapes.ANCHOR_SHAPE in shapes.QUICK_SHAPES and len(shapes.FULL_SHAPES) == 7


def test_autodiff_baseline_matches_recurrence():
    """The "what a JAX user has" baseline computes the same function (float64, mild decays)."""
    import jax

    from benchmarks import autodiff_baseline
    from rewy_jax import testing
    from rewy_jax.reference import l2norm

    with jax.enable_x64(True) if hasattr(jax, "enable_x64") else jax.experimental.enable_x64():
        for op in ("gdn", "gdn2"):
            x = testing.make_inputs(op, 1, 128, 2, 8, dtype=jnp.float64, seed=4)
            x = {k: v.astype(jnp.float64) for k, v in x.items()}
            x["q"], x["k"] = l2norm(x["q"]), l2norm(x["k"])
            gates = {n: x[n] for n in testing.OPS[op].gates}
            o, s = autodiff_baseline.op_call(op, x["q"], x["k"], x["v"], gates,
                                             initial_state=x["initial_state"], precision="highest")
            o_r, s_r = testing.run_op(op, x, backend="reference")
            assert testing.ratio(o, o_r) < 1e-5 and testing.ratio(s, s_r) < 1e-5


def test_refusing_implementation_is_reported(tmp_path, monkeypatch):
    """An implementation that raises on the call (e.g. jla's "head dims must be in (64, 128)") is a
    'refused' row with the reason, not a crash; an implementation not registered is 'skipped'."""
    from benchmarks import impls, run

    class Refuses(impls.JaxImpl):
        family, name = "jla", "refuses"

        def call(self, op, q, k, v, gates, output_final_state):
            raise ValueError("head dims must be in (64, 128)")

    seen = []
    monkeypatch.setattr(impls, "all_impls", lambda quick, backends_=None, kernel_config=None: (
        seen.append(kernel_config) or [Refuses(), impls.Ours("no_such_backend", "rewy", "recompute")]))
    assert run.main(["--cpu-smoke", "--shapes", TINY, "--ops", "deltanet", "--rounds", "1",
                     "--out-dir", str(tmp_path), "--stem", "r", "--kernel-config", "twin_pass=false",
                     "--kernel-config", "backward_low_precision=S0,dS", "--variant", "nopd+lw4",
                     "--kernel-config", "warps.bwd_dlam=8"]) == 0
    # the rows' KernelConfig overrides: the variant's, then --kernel-config's, merged
    assert seen == [{"twin_pass": False, "backward_low_precision": ("S0", "dS"),
                     "fwd_predecayed": False, "warps": {"bwd_leaf": 4, "bwd_dlam": 8}}]
    assert "--kernel-config twin_pass=false" in json.loads(
        (tmp_path / "r.json").read_text())["meta"]["command"]
    rows = {r["impl"]: r for r in json.loads((tmp_path / "r.json").read_text())["rows"]}
    assert rows["refuses"]["status"] == "refused" and "head dims" in rows["refuses"]["reason"]
    assert rows["ours no_such_backend rewy/recompute"]["status"] == "skipped"
    assert "head dims" in (tmp_path / "r.md").read_text()


def test_nonfinite_full_shape_is_a_failure():
    """A NaN/inf in an implementation's full-shape output or gradients fails its row (even when
    the reduced-shape accuracy passed) and keeps it out of the headline's best variant."""
    from benchmarks import impls, report

    assert impls._all_finite({"a": jnp.ones(3), "i": jnp.arange(3)})
    assert not impls._all_finite([jnp.ones(3), jnp.array([1.0, jnp.nan])])
    ok = {"family": "ours", "status": "ok", "ms": {"fwdbwd": 2.0}, "impl": "slow",
          "accuracy": {"status": "pass", "worst_name": "o", "worst_ratio": 1e-3, "worst_tol": 5e-3}}
    bad = dict(ok, impl="fast", ms={"fwdbwd": 1.0}, nonfinite=["fwdbwd"])
    assert "FAIL" in report.acc_cell(bad) and "fwdbwd" in report.acc_cell(bad)
    assert report.best_ours([ok, bad])["impl"] == "slow"


def test_noisy_rows_are_marked():
    """A row whose fwd+bwd quartiles differ by more than report.NOISY_IQR gets '≈' beside its
    time in both tables; a tight one does not."""
    from benchmarks import report

    base = {"family": "ours", "status": "ok", "op": "kda", "shape": "1x128x2x32",
            "impl": "ours a", "ms": {"fwd": 1.0, "fwdbwd": 2.0}, "spread_ms": {"fwdbwd": [1.9, 2.1]}}
    wide = dict(base, impl="ours b", spread_ms={"fwdbwd": [2.0, 4.0]})
    assert not report.noisy(base) and report.noisy(wide) and not report.noisy({"ms": {}})
    md = report.markdown({"meta": {}, "rows": [base, wide]})
    assert "| ours b | 1.000 | 1.000 | 2.000 ≈ |" in md and "| ours a | 1.000 | 1.000 | 2.000 |" in md


def test_gpu_turn_is_a_readers_writer_lock(tmp_path):
    """benchmarks.run.gpu_turn (side-by-side processes): a timing turn (exclusive) excludes
    everyone; set-up turns (shared) overlap each other but exclude a timing turn; a waiting
    timing turn (holding the turnstile) keeps new set-ups out; without a lock file a no-op."""
    import fcntl

    from benchmarks.run import gpu_turn

    def can(path, mode):
        with open(path, "a") as other:
            try:
                fcntl.flock(other, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            fcntl.flock(other, fcntl.LOCK_UN)
            return True

    with gpu_turn(None):
        pass
    lock = str(tmp_path / "gpu.lock")
    with gpu_turn(lock):
        assert not can(lock, fcntl.LOCK_EX) and not can(lock, fcntl.LOCK_SH)
        assert can(lock + ".turn", fcntl.LOCK_EX)  # the turnstile is only held while waiting
    with gpu_turn(lock, shared=True):
        assert can(lock, fcntl.LOCK_SH) and not can(lock, fcntl.LOCK_EX)
        with gpu_turn(lock, shared=True):  # another set-up overlaps
            pass
    assert can(lock, fcntl.LOCK_EX)  # released on exit
    with open(lock + ".turn", "a") as waiting_writer:  # a timing turn waiting at the turnstile
        fcntl.flock(waiting_writer, fcntl.LOCK_EX)
        assert not can(lock + ".turn", fcntl.LOCK_EX)  # so a new set-up turn would wait


def test_interpret_accuracy_tool_reports_both_storages(monkeypatch):
    """benchmarks/interpret_accuracy.py: the benchmark's accuracy check of our kernels on CPU —
    both backward storages pass at a small shape, the bf16 one moves the gradients (not o),
    and its rows start from the caller's base overrides (here the 16-bit kernels at D = 32,
    which KernelConfig.narrow_keys would run in fp32)."""
    from benchmarks import interpret_accuracy

    reps = interpret_accuracy.check("gdn", 2, 32, T=96, tune={"backward_native_pass_dots": False},
                                    base={"narrow_keys": 0})
    third = "bf16-backward + backward_native_pass_dots=False"
    assert set(reps) == {"bf16-backward", "fp32-backward", third}
    assert all(r["status"] == "pass" for r in reps.values())
    lo, hi, nat = (reps[n]["ratios"] for n in ("bf16-backward", "fp32-backward", third))
    assert lo["o"] == hi["o"] == nat["o"] and lo["dk"] != hi["dk"] != nat["dk"] != lo["dk"]


def test_timed_fwd_bwd_is_the_output_and_its_vjp():
    """The benchmark's and trace's fwd+bwd (testing.output_and_vjp, torch.autograd.grad's form):
    the op's output and the gradients of ⟨o, do⟩, with no loss reduced in the timed program."""
    import jax

    from rewy_jax import testing

    x = testing.make_inputs("deltanet", 1, 40, 2, 16, 16, dtype=jnp.bfloat16, initial_state=False)
    do = jax.random.normal(jax.random.PRNGKey(3), x["v"].shape).astype(jnp.bfloat16)

    def fwd(y):
        return testing.run_op("deltanet", y, backend="xla")[0]

    o, grads = jax.jit(lambda y: testing.output_and_vjp(fwd, y, do))(x)
    ref = jax.grad(lambda y: jnp.sum(fwd(y).astype(jnp.float32) * do.astype(jnp.float32)))(x)
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(fwd(x), np.float32))
    for n in ("q", "k", "v", "beta"):
        np.testing.assert_allclose(np.asarray(grads[n], np.float32),
                                   np.asarray(ref[n], np.float32), rtol=2e-2, atol=2e-2)
    jaxpr = str(jax.make_jaxpr(lambda y: testing.output_and_vjp(fwd, y, do))(x))
    loss_jaxpr = str(jax.make_jaxpr(jax.grad(lambda y: jnp.sum(fwd(y).astype(jnp.float32)
                                                               * do.astype(jnp.float32))))(x))
    assert jaxpr.count("reduce_sum") < loss_jaxpr.count("reduce_sum")


@pytest.mark.skipif(not __import__("pallas_kernels.mosaic_gpu.compat", fromlist=["x"]).has_interpreter(),
                    reason="the Mosaic GPU interpreter needs jax >= 0.12")
def test_kernel_ab_prepares_trees_and_times_each(tmp_path, monkeypatch):
    """benchmarks.kernel_ab: `prepare` extracts a commit's kernels and op, `run --smoke` times each
    tree in its own process from that tree's code (it raises if a tree imports others), a case
    a tree lacks is reported by its error, not fatal; `trees` picks trees and `log_dir` keeps
    each tree's output."""
    import subprocess

    from benchmarks import kernel_ab

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    monkeypatch.chdir(repo)
    monkeypatch.setattr(kernel_ab, "AB_DIR", str(tmp_path))
    kernel_ab.prepare(["HEAD"])
    assert os.path.isfile(tmp_path / "HEAD" / "pallas_kernels" / "mosaic_gpu" / "chunk_inverse.py")
    assert os.path.isfile(tmp_path / "HEAD" / "rewy_jax" / "backends.py")  # the op's glue too
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("PYTHONPATH", repo)
    os.makedirs(tmp_path / "other")  # a tree left out by `trees`
    cases = ["t0", "chunk_backward_deltanet", "vector_chunk_runtime", "op_kda_fwd_runtime", "op_gdn_fwd"]
    out = kernel_ab.run(cases, limit=600, smoke=True, log_dir=str(tmp_path / "logs"), trees=["HEAD"])
    assert out == {"HEAD": dict.fromkeys(cases, 0.0)}, out
    assert os.listdir(tmp_path / "logs") == ["HEAD.log"]
    assert '"t0": 0.0' in (tmp_path / "logs" / "HEAD.log").read_text()


@pytest.mark.parametrize("op", ["kda", "gdn2"])
def test_mosaic_vector_parts_run_every_kernel(op):
    """benchmarks.mosaic_kernels.vector_parts (each vector kernel timed alone, with the leaf maps
    the op runs in the gradient kernel) calls every kernel as the op does: in the GPU interpreter
    at a small shape each part runs once."""
    from benchmarks import mosaic_kernels
    from pallas_kernels.mosaic_gpu import compat

    if not compat.has_interpreter():
        pytest.skip("the Mosaic GPU interpreter needs jax >= 0.12")
    out = mosaic_kernels.vector_parts(op, shapes.Shape(1, 128, 1, 64), interpret=compat.interpret_params(True))
    assert "chunk backward" in out and set(out.values()) == {0.0}, out
