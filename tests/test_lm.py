"""The small language model of examples/lm.py: every mixer, optax training, checkpoints, decoding."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import lm  # noqa: E402

REF = {"backend": "reference"}  # the token recurrence: cheap to compile, same math


def _cfg(mixer, **kw):
    opts = kw.pop("mixer_options", {} if mixer == "attention" else dict(REF))
    return lm.LMConfig(vocab_size=32, d_model=32, n_layers=2, num_heads=2, mixer=mixer,
                       mixer_options=opts, **kw)


def _tokens(B=2, T=12, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 32, (B, T)), jnp.int32)


@pytest.mark.parametrize("mixer", lm.MIXERS)
def test_forward_shapes_and_tied_head(mixer):
    model = lm.LanguageModel(_cfg(mixer), rngs=nnx.Rngs(0))
    logits = nnx.jit(lambda m, t: m(t))(model, _tokens())
    assert logits.shape == (2, 12, 32) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))
    blocks = sum(lm.count_params(b) for b in model.blocks)
    # embedding (shared with the head) + blocks + final norm; no separate output matrix
    assert lm.count_params(model) == 32 * 32 + blocks + 32


def test_training_with_optax_lowers_the_loss():
    model = lm.LanguageModel(_cfg("gdn2"), rngs=nnx.Rngs(0))
    opt = lm.make_optimizer(model, lr=1e-2, steps=12, warmup=2)
    seq = np.tile(np.arange(13, dtype=np.int32) % 7, (4, 1))  # a periodic sequence: learnable
    batch = (seq[:, :-1], seq[:, 1:], np.ones((4, 12), bool))
    losses = [float(lm.train_step(model, opt, *batch)[0]) for _ in range(12)]
    assert losses[-1] < 0.7 * losses[0], losses


def test_checkpoint_round_trip(tmp_path):
    cfg = _cfg("kda", mixer_options={**REF, "gate_mode": "bounded"})
    model = lm.LanguageModel(cfg, rngs=nnx.Rngs(3))
    path = str(tmp_path / "ckpt.npz")
    lm.save_checkpoint(path, model)
    with np.load(path) as data:  # a plain, documented format
        assert "__config__" in data.files and "embed/embedding" in data.files
        assert "blocks/0/mixer/q_proj/kernel" in data.files
    restored = lm.load_checkpoint(path)
    assert restored.config == cfg
    a = jax.tree.leaves(nnx.state(model, nnx.Param))
    b = jax.tree.leaves(nnx.state(restored, nnx.Param))
    assert len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
    fwd = nnx.jit(lambda m, t: m(t))
    np.testing.assert_array_equal(fwd(restored, _tokens()), fwd(model, _tokens()))

    # a checkpoint that does not match its config is rejected, naming the parameter
    with np.load(path) as data:
        arrays = dict(data)
    arrays["blocks/0/mixer/q_proj/kernel"] = arrays["blocks/0/mixer/q_proj/kernel"][:, :3]
    bad = str(tmp_path / "bad.npz")
    np.savez(bad, **arrays)
    with pytest.raises(ValueError, match="q_proj/kernel"):
        lm.load_checkpoint(bad)


def test_lm_decode_matches_full_forward():
    model = lm.LanguageModel(_cfg("gdn", mixer_options={**REF, "recurrent_max_len": 2}),
                             rngs=nnx.Rngs(0))
    toks = _tokens(T=10)
    full = nnx.jit(lambda m, t: m(t))(model, toks)
    model.init_cache(2)
    step = nnx.jit(lambda m, t: m(t, decode=True))
    out = [step(model, toks[:, :6])] + [step(model, toks[:, t:t + 1]) for t in range(6, 10)]
    np.testing.assert_allclose(jnp.concatenate(out, axis=1), full, rtol=1e-4, atol=1e-4)
    sample = lm.generate(model, toks[:, :4], 3)
    assert sample.shape == (2, 3) and sample.dtype == jnp.int32


def test_bad_mixer_and_attention_decode():
    with pytest.raises(ValueError, match="mixer"):
        lm.LMConfig(mixer="mamba")
    model = lm.LanguageModel(_cfg("attention"), rngs=nnx.Rngs(0))
    with pytest.raises(NotImplementedError, match="decode"):
        model.init_cache(1)
