"""The vector-gate (KDA, GDN2) Mosaic GPU kernels: the forward and the ReWY backward in the GPU
interpreter against float64, lowering of every kernel for CUDA, the SMEM budget, supports()'s
reasons and dispatch, all on CPU.

Each interpreted case redraws its inputs: T not a multiple of the chunk, an initial state, β / b
and w in [0, 2], and per-channel gates that are either strong (most channels mild so the state
matters, some down to −10, a few −50 and −inf: the exact frames), declared-bounded (g in
[−5, 0], a tenth exactly −5: the centred diagonal blocks), or mixed (undeclared, in [−1, 0]
but for a few −inf in the second chunk: that chunk takes the exact frames, the others the
centred ones, each chosen at run time), or mild (undeclared, all in [−1, 0]: every chunk
qualifies, so the call takes the kernel built for a declared bound). o and the final state must meet
rewy-math §8's bf16 bound (ratio ≤ 5e-3); the backward cases (through ``chunk_kda`` /
``chunk_gdn2``, both policies, a final-state cotangent) check every gradient against §8's bounds.
"""

from __future__ import annotations

import os
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import chunk_algebra as ca
from pallas_kernels.mosaic_gpu import compat, config
from pallas_kernels.mosaic_gpu.prep import LOG2E
from pallas_kernels.mosaic_gpu.vector_chunk import vector_chunk, vector_wu
from pallas_kernels.mosaic_gpu.vector_forward import vector_forward, vector_state_output
from pallas_kernels.mosaic_gpu.vector_prep import prepare_vector
from rewy_jax.reference import reference_general
from rewy_jax.testing import ratio, tolerance

# REWY_MOSAIC_ON_GPU=1 runs the same cases compiled on an sm_90 GPU instead of interpreted
# (docs/mosaic-gpu.md, "Checking on a GPU").
INTERPRET = os.environ.get("REWY_MOSAIC_ON_GPU") != "1"
needs_interpreter = pytest.mark.skipif(INTERPRET and not compat.has_interpreter(),
                                       reason="the Mosaic GPU interpreter needs jax >= 0.12")

BF16 = jnp.bfloat16
F16 = jnp.float16
F32 = jnp.float32


def _gates(rng, shape, kind):
    if kind == "mild":
        return -rng.uniform(0, 1, shape)
    if kind == "mixed":  # undeclared, mild (centred chunks) but for the second chunk's resets
        g = -rng.uniform(0, 1, shape)
        second = g[:, 64:128]
        second[rng.uniform(size=second.shape) < 0.02] = -np.inf
        return g
    if kind == "bounded":
        g = -rng.uniform(0, 5, shape)
        g[rng.uniform(size=shape) < 0.1] = -5.0
        return g
    g = -rng.uniform(0, 0.5, shape)
    u = rng.uniform(size=shape)
    g[u < 0.2] = -rng.uniform(0, 10, int((u < 0.2).sum()))
    g[(u >= 0.2) & (u < 0.22)] = -50.0
    g[(u >= 0.22) & (u < 0.23)] = -np.inf
    return g


def _case(op, T, H, D, seed, gates, n_seq=None, dtype=BF16):
    """float64 arrays (q, k, v representable in ``dtype``; q, k unit rows as the layers feed them);
    ``n_seq``: that many packed sequences of random lengths (h0 per sequence, and ``cu``)."""
    rng = np.random.default_rng(seed)
    r16 = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float64))  # noqa: E731
    nrm = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    B = 1
    x = dict(q=r16(nrm(rng.standard_normal((B, T, H, D)))), k=r16(nrm(rng.standard_normal((B, T, H, D)))),
             v=r16(rng.standard_normal((B, T, H, D))), g=_gates(rng, (B, T, H, D), gates),
             h0=rng.standard_normal((B if n_seq is None else n_seq, H, D, D)) * 0.3)
    if op == "kda":
        x["beta"] = rng.uniform(0, 2, (B, T, H))
    else:
        x["b"] = rng.uniform(0, 2, (B, T, H, D))
        x["w"] = rng.uniform(0, 2, (B, T, H, D))
    if n_seq is not None:
        cuts = np.sort(rng.choice(np.arange(1, T), n_seq - 1, replace=False))
        x["cu"] = np.concatenate([[0], cuts, [T]]).astype(np.int32)
    return x


def _gate_kwargs(x, dtype):
    names = ("beta",) if "beta" in x else ("b", "w")
    return {n: jnp.asarray(x[n], dtype) for n in names}


@needs_interpreter
@pytest.mark.parametrize("op,D,T,H,gates,seed,dtype", [
    ("kda", 64, 100, 2, "strong", 0, BF16),
    ("gdn2", 64, 130, 1, "strong", 1, BF16),
    ("kda", 64, 70, 2, "bounded", 2, BF16),
    ("gdn2", 64, 150, 1, "bounded", 3, BF16),
    ("kda", 128, 70, 1, "strong", 4, BF16),
    ("gdn2", 128, 100, 1, "bounded", 5, BF16),
    ("kda", 64, 200, 1, "mixed", 6, BF16),
    ("gdn2", 64, 130, 1, "mild", 8, BF16),
    # fp16: the Gram operands stay bf16 (centred factors reach e^40), A's pair, Ē and W are fp16
    ("kda", 64, 100, 1, "bounded", 9, F16),
    ("gdn2", 64, 90, 1, "strong", 7, F16),
    # K = 256: the chunk Grams over two key blocks, W/U by vector_wu, the state in four blocks
    ("kda", 256, 100, 1, "strong", 40, BF16),
    ("gdn2", 256, 130, 1, "bounded", 41, BF16),
])
def test_vector_forward_matches_float64(op, D, T, H, gates, seed, dtype):
    x = _case(op, T, H, D, seed, gates, dtype=dtype)
    bound = -5.0 if gates == "bounded" else None
    o, fin = vector_forward(*(jnp.asarray(x[n], dtype) for n in "qkv"), jnp.asarray(x["g"], jnp.float32),
                            h0=jnp.asarray(x["h0"], jnp.float32), gate_lower_bound=bound, interpret=INTERPRET,
                            **_gate_kwargs(x, jnp.float32))
    erase, write = (x["beta"], x["beta"]) if op == "kda" else (x["b"], x["w"])
    ref_args = (x["q"], x["k"], x["v"], x["g"], erase, write)
    ro, rfin = reference_general(*(jnp.asarray(a, jnp.float64) for a in ref_args),
                                 scale=D ** -0.5, initial_state=jnp.asarray(x["h0"]), dtype=jnp.float64)
    bad = {}
    for name, val, ref in (("o", o, ro), ("final_state", fin, rfin)):
        val = np.asarray(jnp.asarray(val, jnp.float32), np.float64)
        assert np.all(np.isfinite(val)), name
        r = ratio(val, np.asarray(ref))
        if r > tolerance(name, BF16):
            bad[name] = r
    assert not bad, f"ratios over rewy-math §8 bf16 bounds: {bad}"


def test_centred_chunks():
    """The per-chunk frame choice: 1 exactly where every 16-row sub-chunk decays by at most
    CENTRED_MAX_DECAY in every channel (float64 recomputation), both values on mixed gates, and
    no chunk centred once a sub-chunk holds a reset gate."""
    from pallas_kernels.mosaic_gpu.vector_prep import CENTRED_MAX_DECAY, centred_chunks

    rng = np.random.default_rng(3)
    B, T, H, D = 1, 256, 2, 64
    g = -rng.uniform(0, 1, (B, T, H, D))
    g[:, 64:128][rng.uniform(size=(B, 64, H, D)) < 0.02] = -np.inf
    g[:, 140, 0, 5] = -2.6  # chunk 2, head 0: one sub-chunk sums to about 10 more
    g[:, 192:208, 1, 7] = -2.6  # chunk 3, head 1: a sub-chunk of 16 × −2.6 = −41.6 > −40
    g2 = prepare_vector(*(jnp.zeros((B, T, H, D), BF16),) * 3, jnp.asarray(g, jnp.float32),
                        beta=jnp.ones((B, T, H), jnp.float32), interpret=INTERPRET)[3]
    flags = np.asarray(centred_chunks(g2))
    assert flags.shape == (B, H, T // 64, 32) and not flags[..., 1:].any()
    gc = np.maximum(g, -40.0).reshape(B, T // 16, 16, H, D).sum(2)  # sub-chunk decays (clamped)
    want = (-gc.reshape(B, T // 64, 4, H, D)).max(axis=(2, 4)) <= CENTRED_MAX_DECAY
    np.testing.assert_array_equal(flags[..., 0], np.swapaxes(want, 1, 2).astype(np.int32))
    assert flags[0, :, 1, 0].tolist() == [0, 0] and flags[0, 1, 3, 0] == 0 and flags[0, 0, 0, 0] == 1


@needs_interpreter
@pytest.mark.parametrize("op,centred,D", [("kda", False, 64), ("gdn2", True, 64), ("kda", True, 256),
                                          ("gdn2", False, 256)])
def test_vector_chunk_matches_chunk_algebra(op, centred, D):
    """The chunk kernel's W, U, Qγ, K_tail and P against chunk_algebra.chunk_local in float64.
    Rounding one value to bf16 alone gives a ratio of ~1.6e-3 (Qγ measured 1.3e-3 to 1.9e-3), W
    and P ~3e-3 (their operands are rounded too); a wrong frame or block is O(1). D = 256: the
    Grams summed over two key blocks, then vector_wu."""
    T, H = 128, 1
    x = _case(op, T, H, D, 7, "bounded" if centred else "strong")
    scale = D ** -0.5
    args = prepare_vector(*(jnp.asarray(x[n], BF16) for n in "qkv"), jnp.asarray(x["g"], jnp.float32),
                          gate_lower_bound=-5.0 if centred else None, interpret=INTERPRET,
                          **_gate_kwargs(x, jnp.float32))
    with compat.x32():
        got = vector_chunk(*args, scale=scale, centred=centred, interpret=compat.interpret_params(INTERPRET))
    got = [np.asarray(jnp.asarray(a, jnp.float32), np.float64)[0, 0].reshape(T // 64, 64, -1) for a in got]
    erase = x["beta"][..., None] * x["k"] if op == "kda" else x["b"] * x["k"]
    write = x["beta"][..., None] * x["v"] if op == "kda" else x["w"] * x["v"]
    G = np.asarray(args[3], np.float64)[0, 0].reshape(T // 64, 64, D) / LOG2E  # the kernel's own G
    chunk = lambda a: a[0, :, 0].reshape(T // 64, 64, -1)  # noqa: E731
    for n in range(T // 64):
        loc = ca.chunk_local(*(jnp.asarray(chunk(a)[n]) for a in (x["q"] * scale, x["k"], erase, write)),
                             ca.make_decay(jnp.asarray(G[n]), 64))
        for name, val, ref in zip(("W", "U", "Qγ", "K_tail", "P"), got,
                                  (loc.W, loc.U, loc.Qg, loc.Kt, loc.P)):
            r = ratio(val[n], np.asarray(ref))
            assert r < 5e-3, (name, n, r)


@needs_interpreter
@pytest.mark.parametrize("op", ["kda", "gdn2"])
def test_vector_wu_matches_chunk_kernel(op):
    """vector_wu (policy "recompute": W, U, Qγ, K_tail from the A the chunk kernel sent out)
    against the chunk kernel's own outputs, D = 128 (two pieces, one CTA each): GDN2 takes the
    same A pair, so every value is the same bits; KDA folds β into hi + lo and splits it again,
    which may move W and U by one rounding of the input dtype (their ratio stays ≤ 1e-3)."""
    D, T, H = 128, 128, 1
    x = _case(op, T, H, D, 3, "strong")
    args = prepare_vector(*(jnp.asarray(x[n], BF16) for n in "qkv"), jnp.asarray(x["g"], jnp.float32),
                          interpret=INTERPRET, **_gate_kwargs(x, jnp.float32))
    ip = compat.interpret_params(INTERPRET)
    with compat.x32():
        full = vector_chunk(*args, scale=0.1, centred=False, out_inverse=True, interpret=ip)
        wu = vector_wu(*args[:5], *full[5:], scale=0.1, interpret=ip)
    for name, got, ref in zip(("W", "U", "Qγ", "K_tail"), wu, full[:4]):
        got, ref = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (got, ref))
        if op == "gdn2" or name in ("Qγ", "K_tail"):
            np.testing.assert_array_equal(got, ref, err_msg=name)
        else:
            assert ratio(got, ref) <= 1e-3, (name, ratio(got, ref))


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("op,centred,dtype", [("kda", False, BF16), ("kda", True, BF16), ("gdn2", False, BF16),
                                              ("gdn2", True, BF16), ("kda", True, F16), ("gdn2", False, F16)])
def test_vector_kernels_lower_for_cuda(D, op, centred, dtype):
    """Both kernels lower to Mosaic GPU for sm_90 on this CPU (layouts, transfers, barriers)."""
    S = jax.ShapeDtypeStruct
    B, T, H = 2, 256, 2
    tok, g2 = S((B, T, H, D), dtype), S((B, H, T, D), jnp.float32)
    erase = S((B, T, H, D), jnp.float32) if op == "gdn2" else S((B, H, T), jnp.float32)
    cfg = config.default_vector_config(D, D, 2, centred)
    head = S((B, H, T, D), dtype)
    flags = None if centred else S((B, H, T // 64, 32), jnp.int32)
    for f, args in ((lambda q, k, x, g, e, fl: vector_chunk(q, k, x, g, e, fl, scale=0.1, centred=centred),
                     (tok, tok, tok, g2, erase, flags)),
                    (lambda w, u, qg, kt, p, g, h0: vector_state_output(w, u, qg, kt, p, g, h0, cfg=cfg,
                                                                         out_final=True),
                     (head, head, head, head, S((B, H, T, 64), dtype), g2, S((B, H, D, D), jnp.float32)))):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


def test_vector_config_fits_smem():
    """The chosen tilings fit SMEM; K = 128 needs the single output tile; K = 256 takes the blocked
    register state, one stage, and the chunk kernel's Grams over 128-column key blocks."""
    for K in (64, 128, 256):
        cfg = config.default_vector_config(K, K, 2, False)
        for erase in (False, True):
            assert config.vector_chunk_smem_bytes(K, K, 2, erase) <= config.SMEM_BUDGET
        state = config.vector_state_smem_bytes(K, 64, cfg.state.stages, 2, cfg.out_buffers, True,
                                               cfg.state.k_block)
        assert state <= config.SMEM_BUDGET
    assert config.default_vector_config(64, 64, 2, False).out_buffers == 2
    assert config.default_vector_config(128, 128, 2, False).out_buffers == 1
    assert config.vector_chunk_key_block(256) == 128 and config.vector_chunk_key_block(128) == 128
    big = config.default_vector_config(256, 256, 2, True)
    assert (big.state.k_block, big.state.stages, big.state_backward.k_block) == (64, 1, 64), big


def test_vector_forward_refuses():
    q = jnp.zeros((1, 64, 1, 64), BF16)
    g = jnp.zeros((1, 64, 1, 64), jnp.float32)
    beta = jnp.zeros((1, 64, 1), jnp.float32)
    with pytest.raises(ValueError, match="beta"):
        vector_forward(q, q, q, g)
    with pytest.raises(ValueError, match="K = V"):
        big = jnp.zeros((1, 64, 1, 192), BF16)
        vector_forward(big, big, big, jnp.zeros((1, 64, 1, 192), jnp.float32), beta)
    with pytest.raises(ValueError, match="bf16 or fp16 inputs"):
        f = jnp.zeros((1, 64, 1, 64), jnp.float32)
        vector_forward(f, f, f, g, beta)
    with pytest.raises(ValueError, match="gate_lower_bound"):
        vector_forward(q, q, q, g, beta, cfg=config.VectorConfig(centred=True), gate_lower_bound=-10.0)


# ---------------------------------------------------------------------------------------------
# The backward (ReWY) and dispatch: chunk_kda / chunk_gdn2 with backend="mosaic_gpu"
# ---------------------------------------------------------------------------------------------
def _op_grads(op, x, bound, **kw):
    """(names, f) with f(*args) -> (o, final) through the public op."""
    from rewy_jax import chunk_gdn2, chunk_kda

    names = ["q", "k", "v", "g"] + (["beta"] if op == "kda" else ["b", "w"]) + ["h0"]

    def f(*a):
        d = dict(zip(names, a))
        common = dict(initial_state=d["h0"], output_final_state=True, gate_lower_bound=bound, **kw)
        if op == "kda":
            return chunk_kda(d["q"], d["k"], d["v"], d["g"], d["beta"], **common)
        return chunk_gdn2(d["q"], d["k"], d["v"], d["g"], d["b"], d["w"], **common)

    return names, f


def _check_backward(op, D, T, H, gates, seed, policy, n_seq=None, dtype=BF16, backward="rewy", got_out=None,
                    w_dtype=jnp.float32):
    """Every output and gradient of the Mosaic GPU op (interpreter) against the float64
    reference; returns the ratios. ``n_seq``: packed sequences (cu_seqlens, h0 and the final
    state's cotangent per sequence); ``dtype``: q, k, v and dO's; ``w_dtype``: GDN2's write gate's
    (drawn representable in it; dw must come back in it)."""
    x = _case(op, T, H, D, seed, gates, n_seq, dtype)
    if "w" in x:
        x["w"] = np.asarray(jnp.asarray(x["w"], w_dtype).astype(jnp.float64))
    bound = -5.0 if gates == "bounded" else None
    rng = np.random.default_rng(seed + 100)
    cts = dict(o=rng.standard_normal((1, T, H, D)), final=rng.standard_normal((x["h0"].shape[0], H, D, D)))
    cu = x.get("cu")
    names, f = _op_grads(op, x, bound, backend="mosaic_gpu", interpret=INTERPRET, policy=policy,
                         backward=backward, cu_seqlens=None if cu is None else jnp.asarray(cu))
    cast = {"q": dtype, "k": dtype, "v": dtype, "w": w_dtype}
    args = [jnp.asarray(x[n], cast.get(n, jnp.float32)) for n in names]
    (o, fin), vjp = jax.vjp(f, *args)
    grads = vjp((jnp.asarray(cts["o"], dtype), jnp.asarray(cts["final"], jnp.float32)))
    for n, arg, gr in zip(names, args, grads):
        assert gr.dtype == arg.dtype, (n, gr.dtype, arg.dtype)
    _, fref = _op_grads(op, x, bound, backend="reference", cu_seqlens=cu)
    (ro, rfin), rvjp = jax.vjp(fref, *[jnp.asarray(x[n], jnp.float64) for n in names])
    rgrads = rvjp((jnp.asarray(cts["o"]), jnp.asarray(cts["final"], rfin.dtype)))
    key = lambda n: "dinitial_state" if n == "h0" else f"d{n}"  # noqa: E731
    got = dict(o=o, final_state=fin, **{key(n): gr for n, gr in zip(names, grads)})
    ref = dict(o=ro, final_state=rfin, **{key(n): gr for n, gr in zip(names, rgrads)})
    # the clamp's VJP (in gates.gate_grad): exactly no gradient to the gates below the floor
    below = np.asarray(x["g"]) < (ca.RESET_GATE if bound is None else bound)
    assert np.all(np.asarray(got["dg"])[below] == 0), "dg of gates below the floor"
    ratios = {}
    for name, val in got.items():
        val = np.asarray(jnp.asarray(val, jnp.float32), np.float64)
        assert np.all(np.isfinite(val)), name
        ratios[name] = ratio(val, np.asarray(ref[name]))
        if got_out is not None:
            got_out[name] = val
    return ratios


@needs_interpreter
@pytest.mark.parametrize("op,D,T,H,gates,seed,policy,dtype,w_dtype", [
    ("kda", 64, 100, 2, "strong", 10, "save", BF16, None),
    ("gdn2", 64, 130, 1, "strong", 11, "recompute", BF16, F32),
    ("kda", 64, 70, 1, "bounded", 12, "recompute", BF16, None),
    ("gdn2", 64, 90, 1, "bounded", 13, "save", BF16, F32),
    ("kda", 128, 70, 1, "strong", 14, "recompute", BF16, None),
    ("gdn2", 128, 100, 1, "bounded", 15, "save", BF16, BF16),  # w (and dw) in bf16
    ("kda", 64, 150, 1, "mixed", 16, "recompute", BF16, None),
    ("gdn2", 64, 190, 1, "mixed", 17, "save", BF16, F32),
    ("kda", 64, 100, 1, "bounded", 18, "save", F16, None),
    ("gdn2", 64, 80, 1, "strong", 19, "recompute", F16, F16),
    # K = 256: also the gradient kernel's streamed value pieces and the blocked reverse pass
    ("kda", 256, 100, 1, "bounded", 42, "recompute", BF16, None),
    ("gdn2", 256, 90, 1, "strong", 43, "save", BF16, F32),
])
def test_vector_backward_matches_float64(op, D, T, H, gates, seed, policy, dtype, w_dtype):
    ratios = _check_backward(op, D, T, H, gates, seed, policy, dtype=dtype, w_dtype=w_dtype or F32)
    bad = {n: r for n, r in ratios.items() if r > tolerance(n, BF16)}
    assert not bad, f"ratios over rewy-math §8 bf16 bounds: {bad} (all: {ratios})"


@needs_interpreter
@pytest.mark.parametrize("op,centred", [("kda", False), ("gdn2", True)])
def test_vector_chunk_backward_streamed_matches_resident(op, centred, monkeypatch):
    """At V = 256 the gradient kernel streams dO, dR, R, S0ᵀ and dSᵀ one value piece at a time
    (three passes); in the interpreter, where SMEM is not bounded, the kernel that holds them all
    (as at V ≤ 128) runs too, and every output must agree up to fp32 reassociation (the sums over
    value pieces are taken in another order). KDA's leaf maps and GDN2's."""
    from pallas_kernels.mosaic_gpu import vector_chunk_backward as vcb

    D, T, H = 256, 128, 1
    N = T // 64
    rng = np.random.default_rng(31)
    x = _case("kda" if op == "kda" else "gdn2", T, H, D, 31, "bounded" if centred else "strong")
    args = prepare_vector(*(jnp.asarray(x[n], BF16) for n in "qkv"), jnp.asarray(x["g"], jnp.float32),
                          gate_lower_bound=-5.0 if centred else None, interpret=INTERPRET,
                          **_gate_kwargs(x, jnp.float32))
    qp, kp, g2, flags = args[0], args[1], args[3], None if centred else args[5]
    tok = lambda: jnp.asarray(rng.standard_normal((1, T, H, D)), BF16)  # noqa: E731
    st = lambda: jnp.asarray(rng.standard_normal((1, H, N, D, D)) * 0.3, BF16)  # noqa: E731
    a = jnp.asarray(np.tril(rng.standard_normal((1, H, T, 64)) * 0.2), BF16)
    kw = dict(scale=D ** -0.5, centred=centred, interpret=compat.interpret_params(INTERPRET))
    if op == "kda":
        kw["kda_leaf"] = (jnp.asarray(rng.uniform(0, 2, (1, H, T)), jnp.float32), tok())
    elif op == "gdn2":
        kw["gdn2_leaf"] = (jnp.asarray(rng.uniform(0, 2, (1, T, H, D)), jnp.float32),
                           jnp.asarray(rng.uniform(0, 2, (1, T, H, D)), jnp.float32), tok())
        kw["load_sets"] = True  # as GDN2's default config
    ins = (qp, kp, tok(), g2, tok(), tok(), tok(), st(), st(), a, a * 0.01, flags)
    with compat.x32():
        streamed = vcb.vector_chunk_backward(*ins, **kw)
        monkeypatch.setattr(vcb, "GRAD_RESIDENT_PIECES", 4)
        resident = vcb.vector_chunk_backward(*ins, **kw)
    for i, (got, ref) in enumerate(zip(streamed, resident)):
        got, ref = (np.asarray(jnp.asarray(v, jnp.float32), np.float64) for v in (got, ref))
        assert np.all(np.isfinite(got)), i
        assert ratio(got, ref) <= 1e-5, (i, ratio(got, ref))


@needs_interpreter
@pytest.mark.parametrize("op,D,gates,policy", [("kda", 64, "strong", "save"), ("gdn2", 64, "bounded", "recompute"),
                                               ("gdn2", 128, "mixed", "save")])
def test_vector_wy_agrees_with_rewy(op, D, gates, policy):
    """backward="wy" (the seven-product ablation: dT = −(Aᵀ dA Aᵀ)_{s<r} and dĒ = Aᵀ dW in their
    own kernel, vector_wy.py) against "rewy" on the same inputs: both within rewy-math §8's
    bounds of float64; the kernels they share give the same bits (the forward, the reverse state
    pass, and in the gradient kernel dq and Λ's dv / dw); dk and the gate gradients, which take
    the differently formed dT and dĒ, agree to bf16 rounding and differ (the wy kernel ran)."""
    got = {}
    for backward in ("rewy", "wy"):
        got[backward] = {}
        ratios = _check_backward(op, D, 130, 1, gates, 50, policy, backward=backward, got_out=got[backward])
        bad = {n: r for n, r in ratios.items() if r > tolerance(n, BF16)}
        assert not bad, f"{backward}: ratios over rewy-math §8 bf16 bounds: {bad} (all: {ratios})"
    rewy, wy = got["rewy"], got["wy"]
    same = ("o", "final_state", "dq", "dv", "dinitial_state") + (("dw",) if op == "gdn2" else ())
    for name in same:
        np.testing.assert_array_equal(wy[name], rewy[name], err_msg=name)
    apart = {n: ratio(wy[n], rewy[n]) for n in ("dk", "dg", "dbeta" if op == "kda" else "db")}
    assert all(r < tolerance(n, BF16) for n, r in apart.items()), apart
    assert apart["dk"] > 0, apart


@needs_interpreter
@pytest.mark.parametrize("op,T,H,gates,seed,policy", [
    ("kda", 200, 1, "strong", 20, "save"),
    ("gdn2", 170, 1, "bounded", 21, "recompute"),
])
def test_vector_packed_matches_float64(op, T, H, gates, seed, policy):
    """Packed sequences (cu_seqlens: 3 of random lengths, h0 and a final-state cotangent per
    sequence) at D = 64: every output and gradient against the float64 reference, through
    api.pack's layout (each sequence re-laid on a chunk boundary, zero rows between) and the serial
    kernels' per-chunk (reset, slot, end)."""
    ratios = _check_backward(op, 64, T, H, gates, seed, policy, n_seq=3)
    bad = {n: r for n, r in ratios.items() if r > tolerance(n, BF16)}
    assert not bad, f"ratios over rewy-math §8 bf16 bounds: {bad} (all: {ratios})"


def _states_and_reverse(cfg, w, u, qg, kt, p, g2, h0t, do, meta=None, n_slots=0):
    """The recompute policy's one launch (launch.py): the states-only state pass (3 warpgroups)
    beside the reverse state pass (2, and an idle third); h0t doubles as d(final)ᵀ."""
    from pallas_kernels.mosaic_gpu.launch import launch
    from pallas_kernels.mosaic_gpu.vector_forward import vector_state_part
    from pallas_kernels.mosaic_gpu.vector_state_backward import vector_state_backward_part

    states = vector_state_part(w, u, qg, kt, p, g2, h0t, cfg=cfg, out_final=False, save_states=True,
                               meta=meta, out_o=False)
    reverse = vector_state_backward_part(kt, w, qg, p, do, g2, h0t, cfg=cfg.state_backward, meta=meta,
                                         n_slots=n_slots, warpgroups=3)
    return launch([states, reverse], w.shape[0], w.shape[1])


@pytest.mark.parametrize("D", [64, 128, 256])
def test_vector_serial_kernels_lower_for_cuda_packed(D):
    """The two serial vector kernels with packed sequences (meta, h0 / final / d(final) / dh0 per
    slot) lower to Mosaic GPU for sm_90 on this CPU (both forward variants)."""
    from pallas_kernels.mosaic_gpu.common import META
    from pallas_kernels.mosaic_gpu.vector_state_backward import vector_state_backward

    S = jax.ShapeDtypeStruct
    B, T, H, n_slots = 1, 256, 2, 3
    f32 = jnp.float32
    g2, head = S((B, H, T, D), f32), S((B, H, T, D), BF16)
    cc, slots, tok = S((B, H, T, 64), BF16), S((n_slots, H, D, D), f32), S((B, T, H, D), BF16)
    meta = S((T // 64, META), jnp.int32)
    cfg = config.default_vector_config(D, D, 2, False)
    cases = (
        (lambda w, u, qg, kt, p, g, h0, m: vector_state_output(w, u, qg, kt, p, g, h0, cfg=cfg,
                                                                out_final=True, meta=m),
         (head, head, head, head, cc, g2, slots, meta)),
        (lambda w, u, qg, kt, p, g, h0, m: vector_state_output(w, u, qg, kt, p, g, h0, cfg=cfg,
                                                                out_final=False, save_states=True, meta=m),
         (head, head, head, head, cc, g2, slots, meta)),
        (lambda *a: vector_state_backward(*a[:-1], cfg=cfg.state_backward, meta=a[-1], n_slots=n_slots),
         (head, head, head, cc, tok, g2, slots, meta)),
        (lambda *a: vector_state_backward(*a[:-1], None, cfg=cfg.state_backward, meta=a[-1], n_slots=n_slots),
         (head, head, head, cc, tok, g2, meta)),
        (lambda *a: _states_and_reverse(cfg, *a[:5], a[6], a[7], a[5], a[-1], n_slots),  # policy "recompute"
         (head, head, head, head, cc, tok, g2, slots, meta)),
    )
    for f, args in cases:
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


@pytest.mark.parametrize("D,centred,dtype", [(64, False, BF16), (64, True, BF16), (128, False, BF16),
                                             (128, True, BF16), (64, True, F16), (128, False, F16),
                                             (256, False, BF16), (256, True, F16)])
def test_vector_backward_kernels_lower_for_cuda(D, centred, dtype):
    """The backward's kernels (and the forward's variants that save A, the chunk states and R)
    lower to Mosaic GPU for sm_90 on this CPU, and dg's chunk sums (a Pallas Triton kernel) for
    CUDA."""
    from pallas_kernels.gpu.gates import gate_grad
    from pallas_kernels.mosaic_gpu.vector_chunk_backward import vector_chunk_backward
    from pallas_kernels.mosaic_gpu.vector_state_backward import vector_state_backward

    S = jax.ShapeDtypeStruct
    B, T, H = 2, 256, 2
    N = T // 64
    f32 = jnp.float32
    tok, g2, head = S((B, T, H, D), dtype), S((B, H, T, D), f32), S((B, H, T, D), dtype)
    cc, st, st32 = S((B, H, T, 64), dtype), S((B, H, N, D, D), dtype), S((B, H, D, D), f32)
    cfg = config.default_vector_config(D, D, 2, centred)
    flags = None if centred else S((B, H, N, 32), jnp.int32)
    cases = (
        (lambda q, k, x, g, e, fl: vector_chunk(q, k, x, g, e, fl, scale=0.1, centred=centred, out_inverse=True),
         (tok, tok, tok, g2, S((B, H, T), f32), flags)),
        (lambda w, u, qg, kt, p, g, h0: vector_state_output(w, u, qg, kt, p, g, h0, cfg=cfg, out_final=False,
                                                             save_states=True),
         (head, head, head, head, cc, g2, st32)),
        # policy "recompute": W, U, Qγ, K_tail from the kept A (KDA's β, GDN2's b)
        (lambda *a: vector_wu(*a, scale=0.1), (tok, tok, tok, g2, S((B, H, T), f32), cc, cc)),
        (lambda *a: vector_wu(*a, scale=0.1), (tok, tok, tok, g2, S((B, T, H, D), f32), cc, cc)),
        (lambda *a: vector_state_backward(*a, cfg=cfg.state_backward),
         (head, head, head, cc, tok, g2, st32)),
        # policy "recompute": the states-only pass and the reverse pass in one launch
        (lambda *a: _states_and_reverse(cfg, *a), (head, head, head, head, cc, g2, st32, tok)),
        (lambda *a: vector_chunk_backward(*a[:12], scale=0.1, centred=centred, kda_leaf=a[12:]),  # KDA's
         (tok, tok, tok, g2, tok, tok, tok, st, st, cc, cc, flags, S((B, H, T), f32), tok)),
    )
    for w_dtype in (f32, BF16):  # GDN2's (w, and dw, in its own dtype; the loads in sets, as its config)
        cases += ((lambda *a: vector_chunk_backward(*a[:12], scale=0.1, centred=centred, gdn2_leaf=a[12:],
                                                    load_sets=True),
                   (tok, tok, tok, g2, tok, tok, tok, st, st, cc, cc, flags, S((B, T, H, D), f32),
                    S((B, T, H, D), w_dtype), tok)),)
    if D <= 128:  # the seven-product ablation: dT and dĒ, then the gradient kernel reading them
        from pallas_kernels.mosaic_gpu.vector_wy import vector_wy_products

        for erase in (S((B, H, T), f32), S((B, T, H, D), f32)):
            cases += ((lambda *a: vector_wy_products(*a), (cc, cc, tok, tok, st, tok, g2, erase)),)
        cases += ((lambda *a: vector_chunk_backward(*a[:12], scale=0.1, centred=centred, kda_leaf=a[12:14],
                                                    wy=a[14:]),
                   (tok, tok, tok, g2, tok, tok, tok, st, st, cc, cc, flags, S((B, H, T), f32), tok, cc,
                    S((B, T, H, D), f32))),)
    for f, args in cases:
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
    tok32 = S((B, T, H, D), f32)
    f = lambda a, b: gate_grad(a, b, 64, interpret=False, warps=cfg.gate_grad_warps)  # noqa: E731
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="cuda"))  # Triton asks for the GPU
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(f).trace(tok32, tok32).lower(lowering_platforms=("cuda",)).as_text()
    assert "rewy_gate_grad" in text


def test_vector_backward_config_fits_smem():
    for K in (64, 128, 256):
        cfg = config.default_vector_config(K, K, 2, False)
        stages = cfg.state_backward.stages
        assert config.vector_state_backward_smem_bytes(K, 64, stages, 2, cfg.state_backward.k_block) <= \
            config.SMEM_BUDGET
        for op in ("kda", "gdn2"):
            assert config.vector_chunk_backward_smem_bytes(K, K, 2, op) <= config.SMEM_BUDGET
    assert config.default_vector_config(128, 128, 2, False).state_backward.stages == 2
    # the gradient kernel's loads in sets: GDN2 only (measured; VectorConfig.grad_load_sets)
    assert config.default_vector_config(128, 128, 2, False, op="gdn2").grad_load_sets
    assert not config.default_vector_config(128, 128, 2, False, op="kda").grad_load_sets
    assert config.default_vector_config(64, 64, 2, False).state_backward.stages == 4


def test_vector_supports_says_why_not():
    from pallas_kernels.mosaic_gpu import vector_api

    common = dict(K=128, V=128, dtype=BF16, chunk_size=64, static_scale=True, backward="rewy",
                  packed=False, interpret=True)
    if compat.has_interpreter():
        assert vector_api.supports(**common) is None
        assert vector_api.supports(**{**common, "K": 64, "V": 64}) is None
        assert vector_api.supports(**{**common, "packed": True}) is None  # cu_seqlens: api.pack
        assert vector_api.supports(**{**common, "dtype": F16}) is None
        assert vector_api.supports(**{**common, "K": 256, "V": 256}) is None
        assert vector_api.supports(**{**common, "backward": "wy"}) is None  # the ablation, K <= 128
    for change, words in ((dict(dtype=jnp.float32), "bf16 or fp16"),
                          (dict(K=32, V=32), "K = V"), (dict(K=128, V=64), "K = V"),
                          (dict(chunk_size=32), "chunk_size"), (dict(backward="wy", K=256, V=256), "K = V <= 128"),
                          (dict(static_scale=False), "scale")):
        reason = vector_api.supports(**{**common, **change})
        assert reason is not None and words in reason, (change, reason)
    assert "sm_90" in vector_api.supports(**{**common, "interpret": False})


def test_vector_dispatch_on_hopper(monkeypatch):
    """On an sm_90 GPU, backend="mosaic_gpu" serves bf16 and fp16 KDA and GDN2 at K = V in {64, 128,
    256} and says why it refuses fp32 and K = 32 calls (packed ones it serves); backend=None takes them at
    K = V <= 128 (K = 256 only by name: accuracy checked in the interpreter only) (the GPU is faked, nothing
    runs)."""
    import rewy_jax
    from pallas_kernels.mosaic_gpu import api
    from rewy_jax import backends

    monkeypatch.setattr(backends, "_platform", lambda: "gpu")
    monkeypatch.setattr(api, "is_hopper", lambda: True)

    def call(op, D, dtype=BF16, cu=None):
        z = jnp.zeros((1, 64, 1, D), dtype)
        g = jnp.zeros((1, 64, 1, D), jnp.float32)
        if op == "kda":
            beta = jnp.ones((1, 64, 1), jnp.float32)
            b = w = beta
            kinds, names = ("vector", "scalar", "scalar"), ("g", "beta", None)
        else:
            b, w = jnp.ones((1, 64, 1, D), jnp.float32), jnp.ones((1, 64, 1, D), jnp.float32)
            kinds, names = ("vector", "vector", "vector"), ("g", "b", "w")
        return rewy_jax.ops._prepare(z, z, z, g, b, w, g_kind=kinds[0], b_kind=kinds[1], w_kind=kinds[2],
                                     scale=None, initial_state=None, use_qk_l2norm=False, cu_seqlens=cu,
                                     gate_names=names)

    def picked(*a, name=None, **kw):
        impl = backends.select(name, call(*a, **kw), chunk_size=64, interpret=False)
        return getattr(impl, "__wrapped__", impl)

    for op in ("kda", "gdn2"):
        for D in (64, 128, 256):
            assert picked(op, D, name="mosaic_gpu") is backends.mosaic_gpu_impl, (op, D)
            assert picked(op, D, dtype=F16, name="mosaic_gpu") is backends.mosaic_gpu_impl, (op, D)
            assert (picked(op, D) is backends.mosaic_gpu_impl) == (D <= 128), (op, D)
            cu = jnp.asarray([0, 30, 64], jnp.int32)
            assert picked(op, D, cu=cu, name="mosaic_gpu") is backends.mosaic_gpu_impl, (op, D)
        for kw, words in ((dict(dtype=jnp.float32), "bf16 or fp16"), (dict(D=32), "K")):
            with pytest.raises(NotImplementedError, match=words):
                picked(op, **{"D": 128, **kw}, name="mosaic_gpu")


@needs_interpreter
@pytest.mark.parametrize("op,policy", [("kda", "recompute"), ("gdn2", "save")])
def test_vector_op_forward_alone_matches_differentiated(op, policy):
    """Called without differentiation the op skips the residuals (the chunk kernel writes no A,
    the state pass no states): o and the final state are the same bits as under jax.vjp."""
    x = _case(op, 100, 1, 64, 30, "strong")
    names, f = _op_grads(op, x, None, backend="mosaic_gpu", interpret=INTERPRET, policy=policy)
    args = [jnp.asarray(x[n], BF16 if n in "qkv" else jnp.float32) for n in names]
    alone = jax.jit(f)(*args)
    diff, _ = jax.vjp(f, *args)
    for a, d in zip(alone, diff):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(d, np.float32))
