"""The ops through jax.jit, jax.grad, jax.vmap, jax.checkpoint and variable-length batches.

    python examples/grad_usage.py
"""

import jax
import jax.numpy as jnp

import rewy_jax

B, T, H, K, V = 2, 100, 4, 32, 32
kq, kk, kv, kg, kb, kw, kh = jax.random.split(jax.random.key(0), 7)
q = jax.random.normal(kq, (B, T, H, K), jnp.bfloat16)
k = jax.random.normal(kk, (B, T, H, K), jnp.bfloat16)
v = jax.random.normal(kv, (B, T, H, V), jnp.bfloat16)
g = jax.nn.log_sigmoid(jax.random.normal(kg, (B, T, H, K)) + 3.0)  # per-channel log-decay ≤ 0
b = 2 * jax.nn.sigmoid(jax.random.normal(kb, (B, T, H, K)))  # erase gate in [0, 2]
w = jax.nn.sigmoid(jax.random.normal(kw, (B, T, H, V)))  # write gate
h0 = jax.random.normal(kh, (B, H, K, V))


# 1. A loss through the op, differentiated in every input (including the initial state).
@jax.jit
def loss(q, k, v, g, b, w, h0):
    o, final = rewy_jax.chunk_gdn2(q, k, v, g, b, w, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm=True)
    return jnp.mean(o.astype(jnp.float32) ** 2) + 1e-3 * jnp.mean(final ** 2)


grads = jax.grad(loss, argnums=tuple(range(7)))(q, k, v, g, b, w, h0)
for name, gr in zip("q k v g b w h0".split(), grads):
    print(f"d{name:<3}{str(gr.shape):<20}{gr.dtype}  finite={bool(jnp.all(jnp.isfinite(gr)))}")

# 2. Rematerialised (jax.checkpoint) and the seven-product baseline give the same gradients.
remat = jax.grad(jax.checkpoint(loss))(q, k, v, g, b, w, h0)
print("checkpoint matches:", bool(jnp.allclose(remat.astype(jnp.float32), grads[0].astype(jnp.float32))))

# 3. vmap over an extra leading axis (e.g. ensembles).
o = jax.vmap(lambda q: rewy_jax.chunk_kda(q, k, v, g, b[..., 0])[0])(jnp.stack([q, q]))
print("vmap output:", o.shape)

# 4. Packed variable-length sequences (FLA's cu_seqlens, B = 1), per-sequence states.
cu = jnp.array([0, 17, 64, 100], jnp.int32)
o, finals = rewy_jax.chunk_gated_delta_rule(q[:1], k[:1], v[:1], g[:1, ..., 0], b[:1, ..., 0],
                                            cu_seqlens=cu, output_final_state=True,
                                            use_qk_l2norm=True)
print("varlen:", o.shape, "final states per sequence:", finals.shape)
