"""Flax layers: shapes, dtypes, parameter counts, jit/grad, decoding, variable length, Linen, errors.

Kept fast on 2 CPU cores: tiny widths (hidden 32, T ≤ 24), everything under ``nnx.jit``, and the
token-recurrence backend (``backend="reference"``, cheap to compile) wherever a test is about the
layer rather than the chunked kernels; the chunked XLA path is exercised by the prefill,
variable-length and options tests (and by tests/test_mqar.py through training).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from rewy_jax.layers import (LAYERS, DeltaNet, GatedDeltaNet, GatedDeltaNet2, KimiDeltaAttention,
                             decay_gate, to_linen)
from rewy_jax.layers.modules import get_value

HID, H, K = 32, 2, 16
NAMES = list(LAYERS)
REF = dict(backend="reference")  # the token recurrence: same math, fast to compile
TOL = dict(rtol=1e-4, atol=1e-5)

forward = nnx.jit(lambda m, x: m(x))
forward_packed = nnx.jit(lambda m, x, cu: m(x, cu_seqlens=cu))
decode = nnx.jit(lambda m, x: m(x, decode=True))


def _x(B=2, T=20, seed=1, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), (B, T, HID), dtype)


def _layer(name, **kw):
    return LAYERS[name](HID, H, K, rngs=nnx.Rngs(0), **kw)


def _n_params(module):
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(nnx.state(module, nnx.Param)))


@pytest.mark.parametrize("name", NAMES)
def test_shape_and_dtype(name):
    layer = _layer(name, **REF)
    y = forward(layer, _x())
    assert y.shape == (2, 20, HID) and y.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(y)))
    yb = forward(layer, _x(dtype=jnp.bfloat16))  # the output keeps the residual stream's dtype
    assert yb.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(yb.astype(jnp.float32))))


def test_bf16_compute_keeps_fp32_params():
    layer = _layer("gdn2", dtype=jnp.bfloat16, **REF)
    y = forward(layer, _x(dtype=jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nnx.state(layer, nnx.Param)))


def test_parameter_counts_with_grouped_value_heads():
    # hidden D=32, H=2 q/k heads of K=16, Hv=4 value heads of V=8 (expand_v=0.5), conv W=4.
    D, Hq, Kd, Hv, V, W = 32, 2, 16, 4, 8, 4
    kd, vd = Hq * Kd, Hv * V
    common = D * kd * 2 + D * vd + W * (2 * kd + vd) + V + vd * D  # q,k,v, convs, o_norm, o_proj
    r = V  # gate_low_rank_dim defaults to head_v_dim
    lowrank = lambda out: D * r + r * out  # noqa: E731
    expect = {
        "deltanet": common + D * Hv,  # b_proj (no output gate by default)
        "gdn": common + D * vd + 2 * D * Hv + 2 * Hv,  # g_proj, a/b_proj, A_log, dt_bias
        "kda": common + lowrank(vd) + vd + lowrank(kd) + D * Hq + Hq + kd,  # g_proj(+bias), f, β
        "gdn2": common + lowrank(vd) + vd + lowrank(kd) + Hq + kd + lowrank(kd) + lowrank(vd),
    }
    for name, n in expect.items():
        layer = LAYERS[name](D, Hq, Kd, rngs=nnx.Rngs(0), num_v_heads=Hv, expand_v=0.5)
        assert _n_params(layer) == n, name
        assert (layer.num_v_heads, layer.head_v_dim, layer.key_dim, layer.value_dim) == (Hv, V, kd, vd)
    # FLA's defaults: GDN expand_v = 2; head_dim = hidden_size // num_heads; DeltaNet ungated
    g = GatedDeltaNet(64, 4, rngs=nnx.Rngs(0))
    assert (g.head_dim, g.head_v_dim, g.use_gate) == (16, 32, True)
    assert DeltaNet(64, 4, rngs=nnx.Rngs(0)).use_gate is False


@pytest.mark.parametrize("name", NAMES)
def test_jit_gradients_reach_every_parameter(name):
    layer = _layer(name, **REF)
    grads = nnx.jit(nnx.grad(lambda m, x: jnp.sum(m(x) ** 2)))(layer, _x(T=12))
    flat = nnx.to_flat_state(grads)
    assert len(flat) == len(nnx.to_flat_state(nnx.state(layer, nnx.Param)))
    for path, g in flat:
        g = np.asarray(get_value(g))
        where = f"{name}: {'/'.join(map(str, path))}"
        assert np.all(np.isfinite(g)), where
        assert np.any(g != 0), f"zero gradient for {where}"


@pytest.mark.parametrize("name", NAMES)
def test_decode_prefill_then_steps_equals_full_forward(name):
    # recurrent_max_len=4: the 13-token prefill takes the chunked op, the 1- and 3-token steps
    # the token-recurrent fused_recurrent_* op. Grouped value heads (num_v_heads=4) included.
    layer = _layer(name, recurrent_max_len=4, num_v_heads=4, **REF)
    x = _x(T=20)
    full = forward(layer, x)
    layer.init_cache(2)
    parts = [decode(layer, x[:, :13])]
    parts += [decode(layer, x[:, t:t + 1]) for t in range(13, 17)]
    parts.append(decode(layer, x[:, 17:20]))
    np.testing.assert_allclose(jnp.concatenate(parts, axis=1), full, **TOL)
    assert layer.recurrent_state.shape == (2, 4, K, layer.head_v_dim)
    assert layer.q_conv1d.cache.shape == (2, 3, H * K)
    layer.init_cache(2)  # resets
    np.testing.assert_allclose(decode(layer, x[:, :5]), full[:, :5], **TOL)


def test_decode_with_chunked_xla_prefill():
    # prefill through the chunked XLA path (two chunks of 16, policy "save"), steps recurrent;
    # compared with the full forward on the reference backend: also checks that backend=,
    # chunk_size= and policy= reach the op.
    x = _x(T=24)
    full = forward(_layer("kda", **REF), x)
    layer = _layer("kda", backend="xla", chunk_size=16, policy="save", recurrent_max_len=2)
    np.testing.assert_allclose(forward(layer, x), full, **TOL)
    layer.init_cache(2)
    out = jnp.concatenate([decode(layer, x[:, :21]), decode(layer, x[:, 21:23]),
                           decode(layer, x[:, 23:])], axis=1)
    np.testing.assert_allclose(out, full, **TOL)


def test_variable_length_matches_separate_sequences():
    layer = _layer("gdn2", backend="xla", chunk_size=16)
    ref_layer = _layer("gdn2", **REF)
    lens = [7, 12, 5]
    xs = [_x(B=1, T=n, seed=10 + i) for i, n in enumerate(lens)]
    cu = jnp.array(np.cumsum([0] + lens), jnp.int32)
    packed = forward_packed(layer, jnp.concatenate(xs, axis=1), cu)  # traced offsets under jit
    ref = jnp.concatenate([ref_layer(x) for x in xs], axis=1)
    np.testing.assert_allclose(packed, ref, **TOL)
    # packed prefill, then the N sequences continue as a batch of N
    layer.init_cache(3)
    prefill = nnx.jit(lambda m, x, cu: m(x, cu_seqlens=cu, decode=True))
    out = prefill(layer, jnp.concatenate([x[:, :n - 2] for x, n in zip(xs, lens)], 1),
                  jnp.array(np.cumsum([0] + [n - 2 for n in lens]), jnp.int32))
    assert out.shape == (1, sum(lens) - 6, HID)
    for i in (2, 1):
        step = jnp.concatenate([x[:, n - i:n - i + 1] for x, n in zip(xs, lens)], axis=0)  # [3, 1, D]
        y = decode(layer, step)
        for b, n in enumerate(lens):
            np.testing.assert_allclose(y[b, 0], ref[0, sum(lens[:b]) + n - i], **TOL)


def test_gates():
    a = jax.random.normal(jax.random.key(0), (3, 5, 2, 4)) * 5
    A_log, dt = jnp.log(jnp.array([1.0, 16.0])), jnp.zeros((2, 4))
    g = decay_gate(a, A_log, dt, mode="softplus")
    assert g.shape == a.shape and bool(jnp.all(g <= 0))
    gb = decay_gate(a, A_log, dt, mode="bounded", lower_bound=-5.0)
    assert bool(jnp.all((gb >= -5.0) & (gb <= 0)))  # saturates to the bounds in fp32
    x = _x()
    layer = _layer("kda", gate_mode="bounded", gate_lower_bound=-3.0, **REF)
    assert bool(jnp.all(layer._decay(x) >= -3.0))
    # β ∈ (0, 2) with negative eigenvalues, (0, 1) without
    assert float(_layer("deltanet", allow_neg_eigval=True)._gates(x)[0].max()) > 1.0 - 1e-3
    assert float(_layer("deltanet")._gates(x)[0].max()) < 1.0
    # weak-decay initialisation for short-context tasks
    gdn = _layer("gdn", A_init_range=(1, 2), dt_init_range=(1e-3, 1e-2))
    assert float(gdn._gates(x)[0].min()) > -0.05


def test_linen_bridge():
    # DeltaNet and GDN2 here, GDN inside a Linen model below, KDA in the next test: all four.
    x = _x(T=16)
    for cls in (DeltaNet, GatedDeltaNet2):
        model = to_linen(cls, HID, H, K, **REF)
        variables = jax.jit(model.init)(jax.random.key(0), x)
        assert set(variables) == {"params"}
        y = jax.jit(model.apply)(variables, x)
        assert y.shape == x.shape and bool(jnp.all(jnp.isfinite(y)))

    class Net(nn.Module):  # a layer inside a Linen model, differentiated with jax.grad
        @nn.compact
        def __call__(self, x):
            x = x + to_linen(GatedDeltaNet, HID, H, K, **REF)(nn.LayerNorm()(x))
            return nn.Dense(1)(x)

    net = Net()
    params = jax.jit(net.init)(jax.random.key(1), x)
    g = jax.jit(jax.grad(lambda p: jnp.mean(net.apply(p, x) ** 2)))(params)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(g)[0]]
    assert any("A_log" in p for p in paths)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(g))


def test_linen_matches_nnx_with_the_same_parameters():
    x = _x(T=16)
    layer = KimiDeltaAttention(HID, H, K, rngs=nnx.Rngs(0), **REF)
    model = to_linen(KimiDeltaAttention, HID, H, K, **REF)
    variables = model.init(jax.random.key(0), x)
    flat = {tuple(map(str, path)): v for path, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
    # Partitioned parameters arrive boxed (nnx.bridge.NNXMeta: a ``.value`` attribute in the path).
    params = jax.tree_util.tree_map_with_path(
        lambda p, _: get_value(flat[tuple(str(getattr(k, "key", k)) for k in p
                                          if not isinstance(k, jax.tree_util.GetAttrKey))]),
        variables["params"])
    np.testing.assert_allclose(jax.jit(model.apply)({"params": params}, x), forward(layer, x), **TOL)


@pytest.mark.parametrize("kwargs, arg", [
    (dict(hidden_size=30, num_heads=4), "head_dim"),
    (dict(hidden_size=32, num_heads=2, head_dim=0), "head_dim"),
    (dict(hidden_size=32, num_heads=2, head_dim=16, num_v_heads=3), "num_v_heads"),
    (dict(hidden_size=32, num_heads=2, head_dim=16, expand_v=0.3), "expand_v"),
    (dict(hidden_size=32, num_heads=2, head_dim=16, expand_v=1, head_v_dim=8), "expand_v or head_v_dim"),
    (dict(hidden_size=32, num_heads=2, head_dim=16, chunk_size=48), "chunk_size"),
    (dict(hidden_size=32, num_heads=2, head_dim=16, policy="keep"), "policy"),
    (dict(hidden_size=32, num_heads=2, head_dim=16, backend="cuda"), "backend"),
    (dict(hidden_size=32, num_heads=2, head_dim=16, conv_init="zeros"), "conv_init"),
    (dict(hidden_size=0, num_heads=2), "hidden_size"),
])
@pytest.mark.parametrize("cls", [DeltaNet, GatedDeltaNet2])
def test_bad_configurations_are_rejected(cls, kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        cls(**kwargs, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("cls", [GatedDeltaNet, KimiDeltaAttention, GatedDeltaNet2])
def test_bad_gate_options_are_rejected(cls):
    with pytest.raises(ValueError, match="gate_mode"):
        cls(HID, H, K, rngs=nnx.Rngs(0), gate_mode="exp")
    with pytest.raises(ValueError, match="gate_lower_bound"):
        cls(HID, H, K, rngs=nnx.Rngs(0), gate_mode="bounded", gate_lower_bound=1.0)
    with pytest.raises(ValueError, match="A_init_range"):
        cls(HID, H, K, rngs=nnx.Rngs(0), A_init_range=(2, 1))
    with pytest.raises(TypeError, match="gate_mode"):
        DeltaNet(HID, H, K, rngs=nnx.Rngs(0), gate_mode="softplus")  # DeltaNet has no decay gate


def test_bad_calls_are_rejected():
    layer = _layer("gdn", **REF)
    with pytest.raises(ValueError, match="hidden_size"):
        layer(jnp.zeros((2, 5, HID + 1)))
    with pytest.raises(ValueError, match="init_cache"):
        layer(_x(), decode=True)
    with pytest.raises(ValueError, match="batch size must be 1"):
        layer(_x(), cu_seqlens=jnp.array([0, 10, 20], jnp.int32))
    layer.init_cache(3)
    with pytest.raises(ValueError, match="init_cache with batch=2"):
        layer(_x(), decode=True)


@pytest.mark.parametrize("name", ["kda", "gdn2"])
def test_bounded_gates_declare_their_bound(name, monkeypatch):
    """gate_mode="bounded" guarantees g ≥ gate_lower_bound, so the layer declares it to the
    chunked op (the GPU kernels' centred fast path); softplus gates declare nothing."""
    seen = []
    cls = LAYERS[name]
    op = cls._chunk_op

    def spy(*args, **kw):
        seen.append(kw.get("gate_lower_bound"))
        return op(*args, **kw)

    monkeypatch.setattr(cls, "_chunk_op", staticmethod(spy))
    x = _x()
    y_b = _layer(name, gate_mode="bounded", gate_lower_bound=-4.0, **REF)(x)
    _layer(name, **REF)(x)
    assert seen == [-4.0, None]
    assert bool(jnp.all(jnp.isfinite(y_b)))
