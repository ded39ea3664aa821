"""The kernels a call runs, as text: every op's traced fwd+bwd jaxpr on the pallas_gpu backend,
one file per (op, dtype, K, policy/backward, varlen) case — each ``pallas_call``'s kernel body,
grid, BlockSpecs, name, warps and stages included. Traced, not lowered or run: no GPU needed.

    JAX_PLATFORMS=cpu python -m tools.kernel_fingerprint /tmp/before   # on the old commit
    JAX_PLATFORMS=cpu python -m tools.kernel_fingerprint /tmp/after    # on the new one
    diff -r /tmp/before /tmp/after                                     # empty: same kernels

How a refactor shows it leaves the default kernels unchanged (issue #34: 82 cases identical).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

from pallas_kernels.gpu import api
from rewy_jax import testing


def cases():
    """(op, dtype, K, op keywords, packed sequences or None): every op at fp32 and bf16, K = V
    from 32 to 256 under both policies and backwards, packed sequences, declared gate bounds."""
    out = []
    for op in ("deltanet", "gdn", "kda", "gdn2"):
        for dt in (jnp.bfloat16, jnp.float32):
            for K in (32, 64, 128, 256):
                for kw in ({}, {"policy": "save", "backward": "wy"}):
                    out.append((op, dt, K, kw, None))
            out.append((op, dt, 128, {}, 3))
            out.append((op, dt, 64, {"policy": "save"}, 2))
    out.append(("kda", jnp.bfloat16, 128, {"gate_lower_bound": -5.0}, None))
    out.append(("gdn2", jnp.bfloat16, 64, {"gate_lower_bound": -5.0, "backward": "wy"}, None))
    return out


def main(out_dir):
    # The backend refuses a non-GPU device; tracing (interpret=False: the real launch settings)
    # needs no device, so its check is bypassed for this process.
    api.supports = lambda *a, **k: None
    os.makedirs(out_dir, exist_ok=True)
    T = 128
    for op, dt, K, kw, ns in cases():
        inp = testing.make_inputs(op, 1, T, 2, K, K, dtype=dt, seed=0, n_seqs=ns)
        cts = {"o": jnp.ones((1, T, 2, K), dt),
               "final_state": jnp.ones((1 if ns is None else ns, 2, K, K), jnp.float32)}

        def f(inp, op=op, kw=kw, cts=cts):
            return testing.loss_and_grads(op, inp, cts, backend="pallas_gpu", interpret=False,
                                          chunk_size=64, use_qk_l2norm=True, **kw)

        name = f"{op}-{jnp.dtype(dt).name}-K{K}-{'-'.join(f'{a}{b}' for a, b in kw.items())}-ns{ns}"
        with open(os.path.join(out_dir, name + ".txt"), "w") as fh:
            fh.write(str(jax.make_jaxpr(f)(inp)))
        print(name, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
