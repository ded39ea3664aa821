"""Varying manual axes (``jax.shard_map(..., check_vma=True)``) for loop carries and kernel outputs.

Inside ``jax.shard_map`` with its default ``check_vma=True`` every value has a type that names the
mesh axes along which it varies. Two places in this package create values that JAX cannot type
from their inputs:

* a ``lax.scan`` carry initialised with ``jnp.zeros``: it is invariant, but the body mixes it
  with per-device inputs, so the carry-out varies and scan rejects the mismatch. ``vary_like``
  casts the initial value to the union of the inputs' varying axes (a no-op outside shard_map);
* a ``pallas_call``'s ``out_shape``: an opaque kernel's outputs need their varying axes spelled
  out. ``out_shapes_like`` rebuilds ``ShapeDtypeStruct`` s with the inputs' varying axes.

JAX spells this differently across the releases we support: 0.12 has
``ShapeDtypeStruct(manual_axis_type=ManualAxisType(varying=...))`` and ``aval.manual_axis_type``;
0.11 has ``ShapeDtypeStruct(vma=...)`` and ``aval.vma``. Both are isolated here.
"""

from __future__ import annotations

import jax
from jax import lax

__all__ = ["varying_axes", "vary_like", "out_shapes_like"]


def _axes_of(x) -> frozenset:
    if x is None or not hasattr(x, "shape"):
        return frozenset()
    try:
        aval = jax.typeof(x)
    except TypeError:  # a NumPy array or a Python scalar: invariant
        return frozenset()
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()) or ())


def varying_axes(*xs) -> frozenset:
    """Union of the varying manual axes of the array leaves of ``xs`` (empty outside shard_map)."""
    out = frozenset()
    for leaf in jax.tree_util.tree_leaves(xs):
        out |= _axes_of(leaf)
    return out


def _pvary(x, axes: tuple):
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axes, to="varying")
    return lax.pvary(x, axes)  # jax 0.11


def vary_like(x, *refs):
    """``x`` (an array or a pytree of them) with every leaf cast to vary along each manual axis
    that some array in ``refs`` varies along."""
    want = varying_axes(*refs)

    def cast(leaf):
        missing = want - _axes_of(leaf)
        return _pvary(leaf, tuple(sorted(missing))) if missing else leaf

    return jax.tree_util.tree_map(cast, x) if want else x


def _sds(s, axes: frozenset):
    if not isinstance(s, jax.ShapeDtypeStruct):
        return s
    mat_cls = getattr(jax.sharding, "ManualAxisType", None)
    if mat_cls is not None:
        return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding,
                                    manual_axis_type=mat_cls(varying=axes))
    return jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=s.sharding, vma=axes)  # jax 0.11


def out_shapes_like(out_shape, *args):
    """``out_shape`` (a ShapeDtypeStruct or a pytree of them) whose varying manual axes are the
    union of those of ``args`` — what an elementwise-in-the-mesh kernel produces."""
    axes = varying_axes(*args)
    return jax.tree_util.tree_map(lambda s: _sds(s, axes), out_shape,
                                  is_leaf=lambda s: isinstance(s, jax.ShapeDtypeStruct))
