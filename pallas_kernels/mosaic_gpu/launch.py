"""One kernel launch from one or more independent passes (horizontal fusion).

The serial passes are latency-bound: a CTA walks its chunks one after another and uses a
fraction of its SM, and at the anchor a pass has 64–128 CTAs for 132 SMs. The recompute
policy's backward runs two such passes that do not depend on each other — the states-only
forward (forward.py, ``out_o=False``) and the reverse state pass (state_backward.py) — so one
launch of both lets them share the machine instead of running one after the other.

A :class:`Part` is one pass's inputs, outputs, scratch and body over a grid ``(B, H, blocks)``.
:func:`launch` runs parts side by side in a grid ``(B, H, Σ blocks)``: CTA ``(b, h, v)`` runs
the part whose block range holds ``v``, with its local block index. The parts' SMEM buffers
share their bytes (``plgpu.RefUnion``: a CTA uses one part's), so the launch needs the larger
of their SMEM, not the sum; their barriers are kept apart. Every part must use the same number
of warpgroups (its own ``set_max_registers`` calls run in its own CTAs). One part launches as
it always did (no union).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

from pallas_kernels.mosaic_gpu import compat


@dataclasses.dataclass(frozen=True)
class Part:
    """One pass of a launch.

    args: input arrays; out_type: output ``ShapeDtypeStruct``s; smem: SMEM scratch by name;
    barriers: barrier scratch by name; blocks: CTAs per ``(b, h)``; warpgroups: the pass's
    warpgroups (``lax.axis_index("wg")``); body: ``body(iv, *in_refs, *out_refs, **smem,
    **barriers)``, ``iv`` the CTA's block in ``[0, blocks)`` (``b`` and ``h`` are
    ``lax.axis_index("b")`` and ``("h")``).
    """

    args: tuple
    out_type: tuple
    smem: dict
    barriers: dict
    blocks: int
    warpgroups: int
    body: Callable


def launch(parts, B: int, H: int, *, interpret=None) -> list:
    """Every part's outputs (a list per part) from one kernel over ``(B, H, Σ blocks)``."""
    parts = tuple(parts)
    if len({p.warpgroups for p in parts}) != 1:
        raise ValueError("the parts of one launch must have the same number of warpgroups, got "
                         f"{[p.warpgroups for p in parts]}")
    if len(parts) == 1:
        scratch = {**parts[0].smem, **parts[0].barriers}
    else:
        scratch = dict(union=plgpu.RefUnion(*(p.smem for p in parts)))
        for i, p in enumerate(parts):
            scratch.update({f"p{i}_{name}": bar for name, bar in p.barriers.items()})
    n_in = [len(p.args) for p in parts]
    n_out = [len(p.out_type) for p in parts]

    def body(*refs, **scratch_refs):
        ins, outs = refs[:sum(n_in)], refs[sum(n_in):]
        if len(parts) == 1:
            parts[0].body(lax.axis_index("v"), *ins, *outs, **scratch_refs)
            return
        union = scratch_refs.pop("union")
        iv = lax.axis_index("v")
        first = 0
        for i, p in enumerate(parts):
            i_in, i_out = sum(n_in[:i]), sum(n_out[:i])
            bars = {name: scratch_refs[f"p{i}_{name}"] for name in p.barriers}

            @pl.when((iv >= first) & (iv < first + p.blocks))
            def _(p=p, i_in=i_in, i_out=i_out, bars=bars, smem=union[i], first=first):
                p.body(iv - first, *ins[i_in:i_in + len(p.args)], *outs[i_out:i_out + len(p.out_type)],
                       **smem, **bars)

            first += p.blocks

    # the kernel's name (traces, ncu) is its body's: the parts' bodies' names
    body.__name__ = body.__qualname__ = "__".join(p.body.__name__ for p in parts)
    outs = plgpu.kernel(
        body, out_type=tuple(o for p in parts for o in p.out_type), scratch_types=scratch,
        grid=(B, H, sum(p.blocks for p in parts)), grid_names=("b", "h", "v"),
        num_threads=parts[0].warpgroups, thread_name="wg", compiler_params=compat.compiler_params(),
        interpret=interpret,
    )(*(a for p in parts for a in p.args))
    outs = list(outs)
    result = []
    for n in n_out:
        result.append(outs[:n])
        outs = outs[n:]
    return result
