"""Train a byte-level language model of rewy-jax layers on the Python standard library's sources,
on one device or a mesh (data parallel × context parallel), with checkpoints that resume exactly.

    python examples/train_lm.py --steps 300                          # one device
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python examples/train_lm.py --mesh data=4,seq=2 --steps 300  # 8 (fake CPU) devices
    python examples/train_lm.py --hybrid ...     # one softmax-attention layer in four

* Corpus: every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (present wherever Python
  is), sorted by path, bytes joined; the last 1% is the validation split. Batch ``step`` is a pure
  function of (seed, step), so a resumed run sees the same data as an uninterrupted one.
* Model: examples/lm.py's pre-norm blocks (mixer + SwiGLU, tied byte embedding); the mixer is a
  delta-rule layer (``--mixer gdn|kda|gdn2|deltanet``); with ``--hybrid`` every fourth block is
  causal softmax attention instead (as Qwen3-Next interleaves them).
* Mesh ``--mesh data=D,seq=S``: the step runs inside ``jax.shard_map`` over both axes. Tokens are
  split over batch (``data``) and over time (``seq``: each device holds a contiguous slice of
  every sequence); the delta-rule layers carry their state across ``seq`` with
  ``context_axis="seq"`` (rewy_jax.context_parallel), their short convolutions take a halo from
  the previous device, and the attention layers all-gather keys and values over ``seq``.
  Parameters and optimizer state are replicated; their gradients are summed over the mesh by
  autodiff of the replicated inputs.
* Optimizer: optax AdamW (warmup + cosine decay, clipping, no decay on 1-D parameters).
* Checkpoints: orbax ``CheckpointManager`` under ``--workdir`` (parameters, optimizer state, the
  step and the metric history); ``--resume`` continues from the latest one.
* Output: a tqdm progress bar, and ``<workdir>/bpb.png`` — bits per byte (train, and validation
  every ``--eval-every`` steps) against the step.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import sys
import sysconfig

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lm  # noqa: E402  (the model blocks)

LN2 = math.log(2.0)


# ------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------
def stdlib_corpus(max_bytes: int | None = None) -> np.ndarray:
    """The standard library's ``*.py`` sources as one uint8 array (sorted paths)."""
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    paths = [p for p in paths if "site-packages" not in p]
    if not paths:
        raise FileNotFoundError(f"no *.py files under the standard library path {root!r}")
    chunks, total = [], 0
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        chunks.append(data + b"\n\n")
        total += len(data) + 2
        if max_bytes is not None and total >= max_bytes:
            break
    buf = np.frombuffer(b"".join(chunks), np.uint8)
    return buf[:max_bytes] if max_bytes is not None else buf


def batch_at(data: np.ndarray, step: int, batch: int, seq_len: int, seed: int) -> np.ndarray:
    """[batch, seq_len + 1] windows of ``data``, a pure function of (seed, step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq_len - 1, batch)
    return np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int32)


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------
class ContextParallelAttention(lm.CausalAttention):
    """lm.CausalAttention that also runs on a slice of T (``context_axis``): keys and values are
    all-gathered over the axis and the causal mask uses global positions."""

    def __call__(self, x, *, cu_seqlens=None, decode=False, context_axis=None):
        if context_axis is None:
            return super().__call__(x, cu_seqlens=cu_seqlens, decode=decode)
        if cu_seqlens is not None or decode:
            raise NotImplementedError("context-parallel attention takes neither cu_seqlens nor "
                                      "decode")
        B, T, _ = x.shape
        split = lambda y: y.reshape(B, -1, self.num_heads, self.head_dim)  # noqa: E731
        pos = jax.lax.axis_index(context_axis) * T + jnp.arange(T)
        kv_pos = jax.lax.all_gather(pos, context_axis, tiled=True)
        q = lm.rope(split(self.q_proj(x)), pos)
        k = jax.lax.all_gather(lm.rope(split(self.k_proj(x)), pos), context_axis, axis=1,
                               tiled=True)
        v = jax.lax.all_gather(split(self.v_proj(x)), context_axis, axis=1, tiled=True)
        mask = pos[:, None] >= kv_pos[None, :]
        o = jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])
        return self.o_proj(o.reshape(B, T, -1))


def build_model(cfg: lm.LMConfig, *, hybrid: bool, seed: int) -> lm.LanguageModel:
    """examples/lm.py's model; with ``hybrid`` every fourth block's mixer is softmax attention."""
    rngs = nnx.Rngs(seed)
    model = lm.LanguageModel(cfg, rngs=rngs)
    scale = 1.0 / math.sqrt(2 * cfg.n_layers)
    for i, blk in enumerate(model.blocks):
        if hybrid and i % 4 == 3:
            attn = ContextParallelAttention(cfg.d_model, cfg.num_heads, cfg.head_dim, rngs=rngs,
                                            initializer_range=cfg.initializer_range)
            lm.set_value(attn.o_proj.kernel, lm.get_value(attn.o_proj.kernel) * scale)
            blk.mixer = attn
    return model


def forward(model, tokens, context_axis=None):
    """tokens [B, T] -> logits [B, T, 256] fp32 (T: this device's slice under context_axis)."""
    x = model.embed(tokens)
    for blk in model.blocks:
        x = x + blk.mixer(blk.mixer_norm(x), context_axis=context_axis)
        x = x + blk.mlp(blk.mlp_norm(x))
    return model.embed.attend(model.norm(x)).astype(jnp.float32)


# ------------------------------------------------------------------------------------------------
# Mesh and steps
# ------------------------------------------------------------------------------------------------
def parse_mesh(spec: str | None):
    """"data=4,seq=2" -> a Mesh of the first 8 devices (None: one device, no mesh)."""
    if not spec:
        return None
    axes = {}
    for part in spec.split(","):
        name, _, size = part.partition("=")
        if name not in ("data", "seq") or not size.isdigit() or int(size) < 1:
            raise ValueError(f"--mesh must look like 'data=4,seq=2' (axes data and seq, sizes "
                             f"≥ 1); got {spec!r}")
        axes[name] = int(size)
    shape = (axes.get("data", 1), axes.get("seq", 1))
    n = shape[0] * shape[1]
    if n > jax.device_count():
        raise ValueError(f"--mesh {spec} needs {n} devices; {jax.device_count()} present (on CPU "
                         "set XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    return jax.make_mesh(shape, ("data", "seq"), devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)


def make_tx(lr: float, steps: int, warmup: int, weight_decay: float = 0.1):
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup, 1), max(steps, warmup + 1),
                                               end_value=lr * 0.1)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=weight_decay,
                                   mask=decay_mask))


def make_loss(graphdef, mesh):
    """loss(params, windows [B, T+1]) -> mean next-byte cross-entropy (nats)."""

    def local_sums(params, inputs, targets, context_axis):
        model = nnx.merge(graphdef, params)
        logits = forward(model, inputs, context_axis)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return nll.sum(), jnp.float32(nll.size)

    if mesh is None:
        def loss(params, windows):
            s, n = local_sums(params, windows[:, :-1], windows[:, 1:], None)
            return s / n
        return loss

    cp = "seq" if mesh.shape["seq"] > 1 else None

    def sharded(params, inputs, targets):
        s, n = local_sums(params, inputs, targets, cp)
        return jax.lax.psum(s, ("data", "seq")) / jax.lax.psum(n, ("data", "seq"))

    step_fn = jax.shard_map(sharded, mesh=mesh, in_specs=(P(), P("data", "seq"), P("data", "seq")),
                            out_specs=P())

    def loss(params, windows):
        return step_fn(params, windows[:, :-1], windows[:, 1:])
    return loss


def make_steps(loss, tx):
    @jax.jit
    def train_step(params, opt_state, windows):
        value, grads = jax.value_and_grad(loss)(params, windows)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return train_step, jax.jit(loss)


# ------------------------------------------------------------------------------------------------
# Checkpoints (orbax)
# ------------------------------------------------------------------------------------------------
def checkpoint_manager(workdir: str, every: int):
    import orbax.checkpoint as ocp

    opts = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=every)
    return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")),
                                 options=opts)


def save(mngr, step, params, opt_state, history, force=False):
    import orbax.checkpoint as ocp

    mngr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
        meta=ocp.args.JsonSave({"step": step, "history": history})), force=force)


def restore(mngr, params, opt_state):
    import orbax.checkpoint as ocp

    step = mngr.latest_step()
    if step is None:
        return None
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          {"params": params, "opt_state": opt_state})
    out = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                     meta=ocp.args.JsonRestore()))
    return out["state"]["params"], out["state"]["opt_state"], out["meta"]


def plot_bpb(history: dict, path: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    tr = np.array(history["train"]) if history["train"] else np.zeros((0, 2))
    ax.plot(tr[:, 0], tr[:, 1], lw=1, label="train")
    if history["val"]:
        va = np.array(history["val"])
        ax.plot(va[:, 0], va[:, 1], "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_title(history.get("title", "byte-level LM on the Python stdlib"))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--mixer", default="gdn", choices=sorted(lm.LAYERS))
    ap.add_argument("--hybrid", action="store_true", help="softmax attention in every 4th block")
    ap.add_argument("--backend", default=None, help="rewy_jax backend (default: per device)")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--mesh", default=None, help="e.g. data=4,seq=2 (default: one device)")
    ap.add_argument("--workdir", default="runs/train_lm")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--max-bytes", type=int, default=None, help="use only this much corpus")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-after", type=int, default=None,
                    help="stop (with a checkpoint) after this step, as if interrupted; the "
                         "schedule still spans --steps")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    """Train; returns the history {"train": [[step, bpb]...], "val": [...]}."""
    args = parse_args(argv)
    mesh = parse_mesh(args.mesh)
    data = stdlib_corpus(args.max_bytes)
    n_val = max(len(data) // 100, args.seq_len + 2)
    train_data, val_data = data[:-n_val], data[-n_val:]
    if mesh is not None and (args.batch % mesh.shape["data"] or args.seq_len % mesh.shape["seq"]):
        raise ValueError(f"--batch {args.batch} must divide by data={mesh.shape['data']} and "
                         f"--seq-len {args.seq_len} by seq={mesh.shape['seq']}")

    opts = {"chunk_size": args.chunk_size}
    if args.backend:
        opts["backend"] = args.backend
    cfg = lm.LMConfig(vocab_size=256, d_model=args.d_model, n_layers=args.layers,
                      num_heads=args.heads, mixer=args.mixer, mixer_options=opts)
    model = build_model(cfg, hybrid=args.hybrid, seed=args.seed)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = make_tx(args.lr, args.steps, args.warmup)
    replicated = (None if mesh is None else NamedSharding(mesh, P()))
    if replicated is not None:
        params = jax.device_put(params, replicated)
    opt_state = tx.init(params)
    if replicated is not None:  # the step counters too: every leaf on the whole mesh
        opt_state = jax.device_put(opt_state, replicated)
    train_step, eval_loss = make_steps(make_loss(graphdef, mesh), tx)

    os.makedirs(args.workdir, exist_ok=True)
    mngr = checkpoint_manager(args.workdir, args.ckpt_every)
    history = {"train": [], "val": [], "title": f"{args.mixer}{' hybrid' if args.hybrid else ''}, "
               f"mesh {args.mesh or '1 device'}"}
    start = 0
    if args.resume:
        restored = restore(mngr, params, opt_state)
        if restored is None:
            print(f"no checkpoint under {args.workdir}; starting from step 0")
        else:
            params, opt_state, meta = restored
            start, history = int(meta["step"]), meta["history"]

    windows_sharding = None if mesh is None else NamedSharding(mesh, P("data", None))

    def put(w):
        return jnp.asarray(w) if windows_sharding is None else jax.device_put(w, windows_sharding)

    from tqdm.auto import tqdm

    stop = args.steps if args.stop_after is None else min(args.stop_after, args.steps)
    bar = tqdm(range(start, stop), initial=start, total=args.steps, disable=args.no_progress,
               desc="train", unit="step")
    for step in bar:
        windows = put(batch_at(train_data, step, args.batch, args.seq_len, args.seed))
        params, opt_state, loss = train_step(params, opt_state, windows)
        bpb = float(loss) / LN2
        history["train"].append([step + 1, bpb])
        bar.set_postfix(bpb=f"{bpb:.3f}")
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            vw = put(batch_at(val_data, 0, args.batch, args.seq_len, args.seed + 1))
            history["val"].append([step + 1, float(eval_loss(params, vw)) / LN2])
        save(mngr, step + 1, params, opt_state, history, force=step + 1 == stop)
    mngr.wait_until_finished()
    mngr.close()
    plot_bpb(history, os.path.join(args.workdir, "bpb.png"))
    with open(os.path.join(args.workdir, "history.json"), "w") as f:
        json.dump({"args": vars(args), "config": dataclasses.asdict(cfg), **history}, f)
    if history["val"]:
        print(f"final validation bits per byte: {history['val'][-1][1]:.4f} "
              f"(curve: {os.path.join(args.workdir, 'bpb.png')})")
    return history


if __name__ == "__main__":
    main()
