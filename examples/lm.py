"""A small language model on rewy-jax's mixers, trainable with optax; checkpoints as .npz.

    tokens [B, T] int -> Embed -> N × Block -> RMSNorm -> tied head (x Eᵀ) -> logits [B, T, vocab]
    Block(x) = x + Mixer(RMSNorm(x));  x + MLP(RMSNorm(x))        (pre-norm; MLP = SwiGLU)

Mixer: "deltanet", "gdn", "kda", "gdn2" (the layers of :mod:`rewy_jax.layers`) or "attention"
(causal softmax attention with RoPE, the baseline). Initialisation follows FLA's models: every
projection and the embedding N(0, 0.02²); the residual output projections (mixer ``o_proj``, MLP
``down``) are further scaled by 1/sqrt(2·n_layers) (FLA's ``prenorm_residual_strategy='rescale'``).

Checkpoint format (:func:`save_checkpoint` / :func:`load_checkpoint`): one ``.npz`` holding every
``nnx.Param`` of the model under its '/'-joined path in ``nnx.state`` (e.g.
``blocks/0/mixer/q_proj/kernel``) plus ``__config__``, the :class:`LMConfig` as JSON. Readable with
plain ``numpy.load``.

Run ``python examples/lm.py`` to train a byte-level model for a few hundred steps on this
repository's own source text, save and reload a checkpoint, and sample from it with the decode
cache.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rewy_jax.layers import LAYERS, RMSNorm
from rewy_jax.layers.modules import get_value, set_value

MIXERS = tuple(LAYERS) + ("attention",)


@dataclasses.dataclass
class LMConfig:
    """Model hyper-parameters (all JSON-serialisable: they go into checkpoints)."""

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    num_heads: int = 2
    head_dim: int | None = None  # default d_model // num_heads
    mixer: str = "gdn"  # one of MIXERS
    mlp_ratio: float = 4.0  # SwiGLU hidden = round(mlp_ratio · d_model · 2/3)
    norm_eps: float = 1e-5
    initializer_range: float = 0.02
    mixer_options: dict = dataclasses.field(default_factory=dict)  # extra layer kwargs

    def __post_init__(self):
        if self.mixer not in MIXERS:
            raise ValueError(f"mixer must be one of {MIXERS}; got {self.mixer!r}")


def rope(x, positions, base: float = 10000.0):
    """Rotary position embedding on x [B, T, H, D] (D even) at integer positions [T]."""
    D = x.shape[-1]
    freqs = base ** (-jnp.arange(0, D // 2, dtype=jnp.float32) * 2.0 / D)
    ang = positions.astype(jnp.float32)[:, None] * freqs[None]  # [T, D/2]
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class CausalAttention(nnx.Module):
    """The softmax baseline: multi-head causal attention with RoPE.

        o = softmax(mask(rope(q) rope(k)ᵀ / sqrt(D))) v,   y = o W_o        x, y: [B, T, hidden]
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int | None = None, *,
                 rngs: nnx.Rngs, initializer_range: float = 0.02):
        head_dim = head_dim or hidden_size // num_heads
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE; got {head_dim}")
        self.num_heads, self.head_dim = num_heads, head_dim
        init = nnx.initializers.normal(initializer_range)
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, kernel_init=init, rngs=rngs)  # noqa: E731
        self.q_proj = lin(hidden_size, num_heads * head_dim)
        self.k_proj = lin(hidden_size, num_heads * head_dim)
        self.v_proj = lin(hidden_size, num_heads * head_dim)
        self.o_proj = lin(num_heads * head_dim, hidden_size)

    def __call__(self, x, *, cu_seqlens=None, decode=False):
        if decode:
            raise NotImplementedError("the softmax baseline has no decode cache; use a delta-rule mixer")
        B, T, _ = x.shape
        split = lambda y: y.reshape(B, T, self.num_heads, self.head_dim)  # noqa: E731
        pos = jnp.arange(T)
        mask = jnp.tril(jnp.ones((T, T), bool))
        if cu_seqlens is not None:  # packed sequences: positions restart, no cross-sequence attention
            seq = jnp.searchsorted(jnp.asarray(cu_seqlens)[1:], pos, side="right")
            pos = pos - jnp.asarray(cu_seqlens)[seq]
            mask = mask & (seq[:, None] == seq[None, :])
        q, k = rope(split(self.q_proj(x)), pos), rope(split(self.k_proj(x)), pos)
        o = jax.nn.dot_product_attention(q, k, split(self.v_proj(x)), mask=mask[None, None])
        return self.o_proj(o.reshape(B, T, -1))

    def init_cache(self, batch, dtype=None):
        raise NotImplementedError("the softmax baseline has no decode cache; use a delta-rule mixer")


class SwiGLU(nnx.Module):
    """y = (silu(x W_gate) ⊙ x W_up) W_down."""

    def __init__(self, d_model: int, hidden: int, *, rngs: nnx.Rngs, initializer_range: float):
        init = nnx.initializers.normal(initializer_range)
        lin = lambda i, o: nnx.Linear(i, o, use_bias=False, kernel_init=init, rngs=rngs)  # noqa: E731
        self.gate, self.up, self.down = lin(d_model, hidden), lin(d_model, hidden), lin(hidden, d_model)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def make_mixer(cfg: LMConfig, rngs: nnx.Rngs):
    """The configured mixer, hidden_size = d_model."""
    if cfg.mixer == "attention":
        return CausalAttention(cfg.d_model, cfg.num_heads, cfg.head_dim, rngs=rngs,
                               initializer_range=cfg.initializer_range)
    return LAYERS[cfg.mixer](cfg.d_model, cfg.num_heads, cfg.head_dim, rngs=rngs,
                             initializer_range=cfg.initializer_range, norm_eps=cfg.norm_eps,
                             **cfg.mixer_options)


class Block(nnx.Module):
    """x + Mixer(RMSNorm(x)), then x + MLP(RMSNorm(x))."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        self.mixer_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mixer = make_mixer(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        hidden = int(round(cfg.mlp_ratio * cfg.d_model * 2 / 3))
        self.mlp = SwiGLU(cfg.d_model, hidden, rngs=rngs, initializer_range=cfg.initializer_range)

    def __call__(self, x, *, cu_seqlens=None, decode=False):
        x = x + self.mixer(self.mixer_norm(x), cu_seqlens=cu_seqlens, decode=decode)
        return x + self.mlp(self.mlp_norm(x))


class LanguageModel(nnx.Module):
    """tokens [B, T] int32 -> logits [B, T, vocab_size] fp32 (head tied to the embedding)."""

    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs,
                               embedding_init=nnx.initializers.normal(cfg.initializer_range))
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        scale = 1.0 / math.sqrt(2 * cfg.n_layers)
        for blk in self.blocks:  # FLA's "rescale" of the residual branches' output projections
            for lin in (blk.mixer.o_proj, blk.mlp.down):
                set_value(lin.kernel, get_value(lin.kernel) * scale)

    def __call__(self, tokens, *, cu_seqlens=None, decode=False):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x, cu_seqlens=cu_seqlens, decode=decode)
        return self.embed.attend(self.norm(x)).astype(jnp.float32)

    def init_cache(self, batch: int):
        """Decode caches for every mixer (delta-rule mixers only)."""
        for blk in self.blocks:
            blk.mixer.init_cache(batch)


def count_params(model) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


# ------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------
def masked_xent(logits, targets, mask):
    """Mean cross-entropy and accuracy over positions where mask is true. targets, mask: [B, T]."""
    mask = mask.astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    n = jnp.maximum(mask.sum(), 1.0)
    acc = ((jnp.argmax(logits, -1) == targets) * mask).sum() / n
    return (nll * mask).sum() / n, acc


def make_optimizer(model, *, lr: float = 3e-3, steps: int = 1000, warmup: int = 50,
                   weight_decay: float = 0.1, clip: float = 1.0):
    """AdamW with linear warmup and cosine decay, gradient clipping; no decay on 1-D params
    (norm weights, biases, A_log, dt_bias), as FLA's trainers do."""
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), max(steps, warmup + 1),
                                               end_value=lr * 0.1)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # noqa: E731
    tx = optax.chain(optax.clip_by_global_norm(clip),
                     optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask))
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


@nnx.jit
def train_step(model, optimizer, tokens, targets, mask):
    """One optimizer step on next-token loss over mask; returns (loss, accuracy)."""

    def loss_fn(m):
        return masked_xent(m(tokens), targets, mask)

    (loss, acc), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return loss, acc


@nnx.jit
def eval_step(model, tokens, targets, mask):
    return masked_xent(model(tokens), targets, mask)


# ------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------
def save_checkpoint(path: str, model: LanguageModel):
    """Write every nnx.Param of ``model`` and its config to ``path`` (.npz; see module doc)."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    arrays = {"/".join(map(str, k)): np.asarray(get_value(v)) for k, v in flat}
    arrays["__config__"] = np.array(json.dumps(dataclasses.asdict(model.config)))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:  # a file object keeps numpy from appending ".npz"
        np.savez(f, **arrays)


def load_checkpoint(path: str) -> LanguageModel:
    """Rebuild the model from a :func:`save_checkpoint` file (shapes and names checked)."""
    with np.load(path) as data:
        cfg = LMConfig(**json.loads(str(data["__config__"])))
        model = LanguageModel(cfg, rngs=nnx.Rngs(0))
        flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
        want = {"/".join(map(str, k)) for k, _ in flat}
        have = set(data.files) - {"__config__"}
        if want != have:
            raise ValueError(f"checkpoint {path} does not match the model: missing "
                             f"{sorted(want - have)[:5]}, unexpected {sorted(have - want)[:5]}")
        for k, v in flat:
            arr = data["/".join(map(str, k))]
            if arr.shape != get_value(v).shape:
                raise ValueError(f"checkpoint {path}: {'/'.join(map(str, k))} has shape "
                                 f"{arr.shape}, the model wants {get_value(v).shape}")
            set_value(v, jnp.asarray(arr, get_value(v).dtype))
    return model


# ------------------------------------------------------------------------------------------------
# Generation (delta-rule mixers: prefill in the chunked form, then recurrent steps)
# ------------------------------------------------------------------------------------------------
@nnx.jit
def _decode(model, tokens):
    return model(tokens, decode=True)[:, -1]


def generate(model: LanguageModel, prompt, n_new: int, *, temperature: float = 0.8, seed: int = 0):
    """Sample ``n_new`` tokens after ``prompt`` [B, T0] (int32) using the decode cache."""
    model.init_cache(prompt.shape[0])
    logits = _decode(model, prompt)
    key = jax.random.key(seed)
    out = []
    for _ in range(n_new):
        key, sub = jax.random.split(key)
        tok = jax.random.categorical(sub, logits / temperature)[:, None].astype(jnp.int32)
        out.append(tok)
        logits = _decode(model, tok)
    return jnp.concatenate(out, axis=1)


def _corpus() -> np.ndarray:
    """This repository's own text (library source and docs) as bytes: no downloads."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    chunks = []
    for sub in ("rewy_jax", "rewy_jax/layers", "examples"):
        d = os.path.join(root, sub)
        for name in sorted(os.listdir(d)):
            if name.endswith((".py", ".md")):
                with open(os.path.join(d, name), "rb") as f:
                    chunks.append(f.read())
    return np.frombuffer(b"\n".join(chunks), np.uint8).astype(np.int32)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mixer", default="gdn", choices=MIXERS)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--backend", default=None, help="op backend (default: fastest for the device)")
    p.add_argument("--out", default="runs/lm", help="checkpoint directory")
    args = p.parse_args(argv)

    mixer_options = {} if args.mixer == "attention" or args.backend is None else {"backend": args.backend}
    cfg = LMConfig(d_model=args.d_model, n_layers=args.n_layers, num_heads=args.num_heads,
                   mixer=args.mixer, mixer_options=mixer_options)
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    opt = make_optimizer(model, lr=args.lr, steps=args.steps, warmup=args.steps // 10)
    data = _corpus()
    rng = np.random.default_rng(0)
    print(f"{args.mixer}: {count_params(model):,} parameters, corpus {len(data):,} bytes")
    t0 = time.time()
    for step in range(1, args.steps + 1):
        starts = rng.integers(0, len(data) - args.seq_len - 1, args.batch_size)
        seq = np.stack([data[s:s + args.seq_len + 1] for s in starts])
        loss, _ = train_step(model, opt, seq[:, :-1], seq[:, 1:], np.ones_like(seq[:, 1:]))
        if step % 50 == 0 or step == 1:
            print(f"step {step:4d}  loss {float(loss):.3f}  ({time.time() - t0:.0f}s)")
    path = os.path.join(args.out, f"lm_{args.mixer}.npz")
    save_checkpoint(path, model)
    restored = load_checkpoint(path)
    seq = np.stack([data[s:s + args.seq_len + 1] for s in rng.integers(0, len(data) - 65, 8)])
    a = eval_step(model, seq[:, :-1], seq[:, 1:], np.ones_like(seq[:, 1:]))[0]
    b = eval_step(restored, seq[:, :-1], seq[:, 1:], np.ones_like(seq[:, 1:]))[0]
    print(f"saved {path}; eval loss {float(a):.4f}, after reload {float(b):.4f}")
    if args.mixer != "attention":
        prompt = jnp.asarray(data[None, :32])
        sample = generate(restored, prompt, 64)
        text = bytes(np.asarray(sample[0]).astype(np.uint8)).decode("utf-8", "replace")
        print("sample:", repr(bytes(np.asarray(prompt[0]).astype(np.uint8)).decode() + text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
