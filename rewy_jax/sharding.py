"""Batch and head sharding under ``jit``: the Pallas kernels run per shard, without gathers.

A ``pallas_call`` is an opaque custom call to XLA's SPMD partitioner: given q/k/v sharded over
batch or heads (``NamedSharding``) it would gather them and run the kernel replicated. The
delta rule is independent per (batch, head), so every shard can run the same kernel on its own
slice. :func:`partitioned` tells XLA so with ``jax.experimental.custom_partitioning``:

* the sharding rule names the factors ``b`` (batch), ``t`` (time), ``h`` (heads), ``k``/``v``
  (features) and ``n`` (packed sequences); ``t``, ``k``, ``v`` and ``n`` must be replicated, ``b``
  and ``h`` keep whatever mesh axes q has on them;
* the per-shard lowering calls the backend unchanged on the local slices.

Autodiff and vmap: ``custom_partitioning`` has neither a VJP nor a batching rule of its own, so the op is a ``custom_vjp`` whose
forward and backward are each one custom-partitioned call. The backward call runs the backend's
``jax.vjp`` per shard: its forward residuals are recomputed there (the backend's own
``policy="recompute"`` work, one forward state pass more for ``policy="save"``). Under ``vmap``
each call falls back to the vmapped per-shard function (``custom_vmap``), which XLA partitions.

The XLA and reference backends are plain jnp/``lax.scan`` programs that XLA partitions over
batch and heads by itself (tests/multidevice/md_jit_sharding.py checks their HLO for gathers),
so only the Pallas backends are wrapped, and only when more than one device is present.

Sequence (T) sharding is a different algorithm: see :mod:`rewy_jax.context_parallel`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["partitioned", "wrap_if_multi_device"]

_ARRAYS = ("q", "k", "v", "g_in", "b", "w", "h0")


def _factors(call, names):
    """Einsum-style factor strings of each array of ``names`` (None arrays are skipped)."""
    lead = "n" if call.cu_seqlens is not None else "b"
    out = []
    for name in names:
        x = getattr(call, name)
        if name == "q" or name == "k":
            out.append("b t h k")
        elif name == "v":
            out.append("b t h v")
        elif name == "h0":
            out.append(f"{lead} h k v")
        elif x.ndim == 3:
            out.append("b t h")
        else:  # per-channel gate: g, b over K; w over V
            out.append("b t h v" if name == "w" else "b t h k")
    return out


def _present(call):
    """The array fields that travel as operands (w only when it is not b itself)."""
    names = [n for n in _ARRAYS if getattr(call, n) is not None]
    if call.w is call.b:
        names.remove("w")
    return names


def _rebuild(call, names, arrays, cu):
    fields = dict(zip(names, arrays))
    if "w" not in fields:
        fields["w"] = fields["b"]
    return call._replace(cu_seqlens=cu, **fields)


def _spec_for(factors: str, bspec, hspec):
    return P(*[bspec if f == "b" else hspec if f == "h" else None for f in factors.split()])


def _make_partition(arg_factors, out_factors, lower_local):
    """custom_partitioning callback: keep q's batch/head mesh axes, replicate everything else."""

    def partition(mesh, arg_shapes, result_shape):
        qspec = tuple(arg_shapes[0].sharding.spec) + (None,) * 4
        bspec, hspec = qspec[0], qspec[2]
        arg_sh = tuple(NamedSharding(mesh, _spec_for(f, bspec, hspec)) for f in arg_factors)
        out_sh = tuple(NamedSharding(mesh, _spec_for(f, bspec, hspec)) for f in out_factors)
        return mesh, lower_local, out_sh, arg_sh

    return partition


def _rule(arg_factors, out_factors):
    return ", ".join(arg_factors) + " -> " + ", ".join(out_factors)


def partitioned(impl, call, *, chunk_size, policy, backward, interpret):
    """``impl(call, ...)`` as a custom-partitioned, differentiable op (see module docstring).

    Returns (o [B, T, H, V], final [B or N, H, K, V] fp32) like every backend.
    """
    if not isinstance(call.scale, (int, float)):  # a traced scale: fold it into q (fp32)
        call = call._replace(q=call.q_scaled, scale=1.0)
    names = _present(call)
    arg_f = _factors(call, names)
    cu_arr = call.cu_seqlens is not None  # traced offsets travel as a replicated operand
    lead = "n" if cu_arr else "b"
    out_f = ["b t h v", f"{lead} h k v"]
    n_arr = len(names)
    kw = dict(chunk_size=chunk_size, policy=policy, backward=backward, interpret=interpret)

    def local_fwd(*args):
        cu = args[n_arr] if cu_arr else None
        return tuple(impl(_rebuild(call, names, args[:n_arr], cu), **kw))

    def local_bwd(*args):
        cu = args[n_arr] if cu_arr else None
        do, dfinal = args[-2:]

        def f(*arrays):
            return tuple(impl(_rebuild(call, names, arrays, cu), **kw))

        _, vjp = jax.vjp(f, *args[:n_arr])
        return tuple(vjp((do, dfinal)))

    fwd_args = arg_f + (["m"] if cu_arr else [])
    bwd_args = fwd_args + out_f
    replicate = ("t", "k", "v") + (("n", "m") if cu_arr else ())
    fwd_cp = custom_partitioning(local_fwd)
    fwd_cp.def_partition(partition=_make_partition(fwd_args, out_f, local_fwd),
                         sharding_rule=_rule(fwd_args, out_f), need_replication_factors=replicate)
    bwd_cp = custom_partitioning(local_bwd)
    bwd_cp.def_partition(partition=_make_partition(bwd_args, arg_f, local_bwd),
                         sharding_rule=_rule(bwd_args, arg_f), need_replication_factors=replicate)
    fwd_cp = _vmappable(fwd_cp, local_fwd)
    bwd_cp = _vmappable(bwd_cp, local_bwd)

    @jax.custom_vjp
    def op(*args):
        return fwd_cp(*args)

    def op_fwd(*args):
        return fwd_cp(*args), args

    def op_bwd(args, cts):
        do, dfinal = cts
        grads = bwd_cp(*args, do, dfinal.astype(jnp.float32))
        return tuple(grads) + ((None,) if cu_arr else ())

    op.defvjp(op_fwd, op_bwd)
    args = [getattr(call, n) for n in names] + ([call.cu_seqlens] if cu_arr else [])
    return op(*args)


def _vmappable(partitioned_fn, local_fn):
    """``partitioned_fn`` with a batching rule: custom_partitioning has none (jax 0.12), so
    under ``vmap`` the per-shard function itself is vmapped (XLA partitions that program)."""
    fn = custom_vmap(lambda *args: partitioned_fn(*args))

    @fn.def_vmap
    def rule(axis_size, in_batched, *args):
        del axis_size
        out = jax.vmap(local_fn, in_axes=tuple(0 if b else None for b in in_batched))(*args)
        return out, tuple(True for _ in out)

    return fn


def _in_manual_context() -> bool:
    """Inside shard_map: the caller already split the arrays; the kernel runs on them as is."""
    mesh = jax.sharding.get_abstract_mesh()
    return bool(getattr(mesh, "manual_axes", ()))


def wrap_if_multi_device(impl, *, unless_interpret=False):
    """``impl`` itself on one device (or inside shard_map); on several, :func:`partitioned`
    around it. ``unless_interpret``: also call it directly when ``interpret`` is set — the TPU
    interpreter runs the kernel through ordered host callbacks, which a custom-partitioned
    lowering cannot hold (jax 0.12), so XLA partitions the interpreter's program itself."""

    @functools.wraps(impl)
    def wrapped(call, *, chunk_size, policy, backward, interpret=False, **settings):
        # settings: backend-specific keywords (pallas_gpu's kernel_config), static
        target = functools.partial(impl, **settings) if settings else impl
        if (jax.device_count() == 1 or _in_manual_context()
                or (unless_interpret and interpret)):
            return target(call, chunk_size=chunk_size, policy=policy, backward=backward,
                          interpret=interpret)
        return partitioned(target, call, chunk_size=chunk_size, policy=policy, backward=backward,
                           interpret=interpret)

    return wrapped
