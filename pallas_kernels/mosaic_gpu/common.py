"""Per-tile helpers shared by the Mosaic GPU kernels (register and SMEM tiles of one warpgroup).

Conventions:
* A chunk is ``C = 64`` tokens: one WGMMA M-tile. Register tiles use the WGMMA layout;
  per-token vectors are loaded in the row (``ROWS``) or column (``COLS``) slice of it.
* Chunk-local log-decays arrive pre-scaled to log2 (``G·log2 e``), so the kernels use ``exp2``.
* Every exponent is masked *before* ``exp2`` (acausal pairs get ``-inf``), so no entry overflows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax import lax

C = 64  # tokens per chunk: the WGMMA M-tile
F32 = jnp.float32
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # the inputs every kernel takes
# Per-chunk metadata of packed sequences: int32 (reset, slot, end) padded to 32 entries, because
# a TMA copy by a 128-thread warpgroup must move a multiple of 128 bytes.
META = 32
WGMMA = plgpu.Layout.WGMMA
ROWS = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a [64, N] register tile
COLS = plgpu.Layout.WGMMA.reduce(0)  # one value per column


def smem(shape, dtype, max_swizzle: int = 128) -> plgpu.SMEM:
    """An SMEM buffer tiled and swizzled so TMA can fill it and WGMMA can read it (minor dim last).

    The two operands of a WGMMA must share one swizzle: a kernel whose narrowest operand has
    32 16-bit columns (64 bytes) gives every operand buffer ``max_swizzle=64``."""
    dtype = jnp.dtype(dtype)
    swizzle = min(plgpu.find_swizzle(shape[-1] * dtype.itemsize * 8), max_swizzle)
    return plgpu.SMEM(shape, dtype, transforms=(
        plgpu.TilingTransform((8, swizzle // dtype.itemsize)), plgpu.SwizzleTransform(swizzle)))


def vectors(stages: int) -> plgpu.SMEM:
    """Per-stage fp32 per-token vectors ``[stages, C]`` (gates, β)."""
    return plgpu.SMEM((stages, C), F32)


def mma(a, b, shape, acc=None, between=None):
    """``acc + a @ b`` on the tensor cores, fp32 result ``shape`` in registers.

    ``b`` is an SMEM ref (``.T`` views allowed for 16-bit operands); ``a`` is an SMEM ref or a
    16-bit register tile in the WGMMA layout ``[64·m, k]`` (a left operand from registers skips
    the store and fence of :func:`stage`; the GPU interpreter of jax ≥ 0.12.1 runs both). A
    register tile that is a right operand goes through :func:`stage`. The product goes into a
    fresh accumulator and ``acc`` is added after it (a pre-initialised accumulator needs
    ``pl.run_state``, which the interpreter cannot run). The result passes an
    optimisation barrier: reading a WGMMA accumulator lowers to a ``wgmma.wait_group`` with no
    data dependence on the accumulator registers, and without the barrier LLVM may schedule
    arithmetic on the result before the wait (stale values).
    """
    return mma_sum(((a, b),), shape, acc, between)


def mma_sum(pairs, shape, acc=None, between=None):
    """``acc + Σ a @ b`` over ``pairs`` of operands as for :func:`mma`, in one accumulator.

    The products are issued back to back into the same accumulator and waited for once, so a
    sum of products costs one round trip to the tensor cores instead of one per term (the
    latency that matters on a serial chain or in a chain of small products). ``between``: see
    :func:`mma_group`.
    """
    (out,) = mma_group(((pairs, shape),), between)
    return out if acc is None else out + acc


def mma_group(specs, between=None):
    """Independent sums of products, one accumulator each, issued together and waited for once.

    ``specs``: a sequence of ``(pairs, shape)`` (``pairs`` as for :func:`mma_sum`); returns the
    fp32 results in order. The tensor cores start the next product while the previous one
    drains, and the warpgroup waits once for all of them. ``between`` (optional, no result)
    runs after the products are issued and before the wait: work that must not delay them
    (a serial chain publishing a tile for another warpgroup: its stores and fence overlap the
    products instead of preceding them). It must not write what the products read.
    """
    def scoped(*acc_refs):
        for acc_ref, (pairs, _) in zip(acc_refs, specs):
            for a, b in pairs:
                plgpu.wgmma(acc_ref, a, b)
        if between is not None:
            between()
        return tuple(acc_ref[...] for acc_ref in acc_refs)

    accs = [plgpu.ACC(shape, F32) for _, shape in specs]
    return lax.optimization_barrier(pl.run_scoped(scoped, *accs))


def stage(ref, x):
    """Store register tile ``x`` into SMEM ``ref`` and fence it for the tensor cores; returns
    ``ref``. The caller owns ``ref`` until the WGMMA that reads it has completed (:func:`mma`
    waits for its result, so the next :func:`stage` into the same ref is safe)."""
    ref[...] = x.astype(ref.dtype)
    plgpu.commit_smem()
    return ref


def put(ref, x):
    """Store register tile ``x`` into SMEM ``ref`` in ``ref``'s dtype, unfenced; returns ``ref``.
    For the several operands of one :func:`mma_group`: each tile is stored as soon as it is
    formed (short register lifetimes) and one ``plgpu.commit_smem()`` fences them all."""
    ref[...] = x.astype(ref.dtype)
    return ref


def iota(shape, dim: int) -> jax.Array:
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WGMMA)


# Index masks of the recursive (bit-level) block schemes, written once. They use ``//`` and ``%``
# on the iota tiles: bitwise forms (xor, and) traced to half as many operations but measured no
# faster for T0 on an H100, and with them the centred vector chunk kernel, otherwise changed
# only in the order of its operations, took 0.744 ms instead of 0.561 (docs/performance-log.md).
def _check_pow2(s: int) -> None:
    if s < 1 or s & (s - 1):
        raise ValueError(f"a bit level must be a power of two, got {s}")


def bit_level_pairs(r, c, s: int):
    """``(r, c)`` pairs whose indices first differ at bit ``s`` (a power of two), with ``r`` in
    the upper and ``c`` in the lower half of their ``2s``-row group: the pairs that level ``s``
    of a recursive block scheme joins (all of them have ``r > c``)."""
    _check_pow2(s)
    return (r // (2 * s) == c // (2 * s)) & (r % (2 * s) >= s) & (c % (2 * s) < s)


def same_block(r, c, size: int):
    """``r`` and ``c`` in the same aligned block of ``size`` (a power of two) rows."""
    _check_pow2(size)
    return r // size == c // size


def upper_half(r, size: int):
    """Rows in the upper half of their aligned ``size``-row group (``r mod size ≥ size/2``)."""
    _check_pow2(size)
    return (r % size) >= size // 2


def rows_of(vec, shape):
    """``vec[i]`` along row ``i`` (``vec`` in ``ROWS``)."""
    return lax.broadcast_in_dim(vec, shape, [0])


def cols_of(vec, shape):
    """``vec[j]`` along column ``j`` (``vec`` in ``COLS``)."""
    return lax.broadcast_in_dim(vec, shape, [1])


def causal_decay(g_row, g_col, *, strict: bool):
    """``[C, C]`` tile ``exp2(G_i − G_j)`` for ``j < i`` (strict) or ``j ≤ i``, zero elsewhere.

    ``g_row``/``g_col``: the chunk's log2 cumulative gates in ``ROWS``/``COLS``; ``None`` means
    no gate (DeltaNet): the tile is the causal 0/1 mask.
    """
    shape = (C, C)
    r, c = iota(shape, 0), iota(shape, 1)
    keep = r > c if strict else r >= c
    if g_row is None:
        return jnp.where(keep, 1.0, 0.0).astype(F32)
    expo = jnp.where(keep, rows_of(g_row, shape) - cols_of(g_col, shape), -jnp.inf)
    return jnp.exp2(expo)


def memory_warpgroup(rings, n_items: int) -> None:
    """The TMA producer warpgroup of the serial kernels: gives up registers (40 per thread) and
    streams items ``0 .. n_items − 1`` through one or more rings.

    ``rings``: ``(copies, stages, in_bar, in_free)`` each. ``copies(i)``: item i's
    ``(GMEM view, SMEM buffer with a stage axis)`` pairs (an iterable, read as the copies are
    issued), loaded into stage ``slot = i mod stages`` on barrier ``in_bar[slot]``. The first
    ``stages`` items go at once, each later one when the consumers have freed its slot
    (``in_free[slot]``); the last releases are observed before the warpgroup finishes. Per item
    the rings are refilled in the order given (a second ring: inputs that one consumer releases
    earlier than the rest, e.g. the fused forward's q, PassConfig.q_stages).
    """
    plgpu.set_max_registers(40, action="decrease")

    def issue(ring, i, slot):
        copies, _, in_bar, _ = ring
        for src, dst in copies(i):
            plgpu.copy_gmem_to_smem(src, dst.at[slot], in_bar.at[slot])

    for ring in rings:
        for i in range(min(ring[1], n_items)):
            issue(ring, i, i)
    first = min(ring[1] for ring in rings)

    @pl.loop(first, n_items)
    def _refill(i):
        for ring in rings:
            stages, in_free = ring[1], ring[3]

            def refill(ring=ring, stages=stages, in_free=in_free):
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(in_free.at[slot])
                issue(ring, i, slot)

            if stages == first:
                refill()
            else:  # a deeper ring: its first items went before the loop
                pl.when(i >= stages)(refill)

    for _, stages, _, in_free in rings:
        for i in range(max(n_items - stages, 0), n_items):
            plgpu.barrier_wait(in_free.at[i % stages])


def finish_together(done) -> None:
    """Every warpgroup arrives at ``done`` and waits for the others before the kernel ends.

    A warpgroup that exits while another still issues WGMMAs has faulted on sm_90
    (``CUDA_ERROR_ILLEGAL_INSTRUCTION``), so warp-specialised kernels end here.
    """
    plgpu.barrier_arrive(done)
    plgpu.barrier_wait(done)


# ---------------------------------------------------------------------------------------------
# An fp32 register state held as column blocks (the serial passes at K = 256, config.PassConfig).
# With one block every helper issues exactly the whole-width sequence (the K ≤ 128 programs).
# ---------------------------------------------------------------------------------------------
def key_block(ref, j: int, kb: int):
    """Columns ``[j·kb, (j+1)·kb)`` of the last axis of ``ref`` (a GMEM, TMA or WGMMA view);
    ``ref`` itself when one block spans the axis. ``kb`` is a multiple of 64, so a slice of a
    swizzled SMEM buffer falls on whole swizzle tiles (64 columns of 16 bits, 32 of fp32)."""
    if kb == ref.shape[-1]:
        return ref
    return ref.at[..., pl.ds(j * kb, kb)]


def blocks_times_t(blocks, ref, kb: int, dtype):
    """``pairs`` for :func:`mma_sum`: ``Σ_j X_j R_jᵀ``, the register tile ``X [M, n·kb]`` held as
    fp32 column blocks ``blocks`` (the left operands, from registers in ``dtype``) times the
    transpose of SMEM ``ref [N, n·kb]`` (its column blocks :func:`key_block`)."""
    return tuple((x.astype(dtype), key_block(ref, j, kb).T) for j, x in enumerate(blocks))


def load_state(state_s, src_of, bar, n_blocks: int):
    """An fp32 state ``[M, n_blocks·kb]`` from GMEM into registers, as ``n_blocks`` tiles
    ``[M, kb]`` (WGMMA layout) through the one-block SMEM buffer ``state_s [M, kb]``;
    ``src_of(j)``: block j's GMEM view. Returns the tuple of tiles."""
    out = []
    for j in range(n_blocks):
        if j:  # every thread has read block j − 1 before TMA overwrites the buffer
            plgpu.commit_smem()
        plgpu.copy_gmem_to_smem(src_of(j), state_s, bar)
        plgpu.barrier_wait(bar)
        out.append(plgpu.load(state_s, layout=WGMMA))
    return tuple(out)


def start_state(state_s, src_of, bar, shape, n_blocks: int = 1):
    """A serial pass's starting fp32 state as ``n_blocks`` register tiles ``shape = [M, kb]``:
    :func:`load_state` from ``src_of(j)``, or zeros when ``src_of`` is None."""
    if src_of is None:
        return tuple(plgpu.layout_cast(jnp.zeros(shape, F32), WGMMA) for _ in range(n_blocks))
    return load_state(state_s, src_of, bar, n_blocks)


def store_state(state_s, blocks, dst_of, *, wait_first: bool) -> None:
    """Register tiles ``blocks`` (fp32 ``[M, kb]``) to GMEM through the one-block SMEM buffer
    ``state_s``, block j to ``dst_of(j)``. Each write first waits until the TMA stores issued
    before it have read their SMEM (for the first block only with ``wait_first``: the caller
    knows whether an earlier store may still read ``state_s``)."""
    for j, x in enumerate(blocks):
        if j or wait_first:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        state_s[...] = x
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(state_s, dst_of(j))


def replace_where(flag, blocks, src_of, state_s, bar):
    """Packed sequences: where ``flag`` (a chunk's reset or end entry of ``meta``) is 1, the
    register state ``blocks`` (a tuple of fp32 tiles) give way to block j of ``src_of(j)`` (a
    GMEM view), loaded through the one-block SMEM buffer ``state_s``; elsewhere they are kept.
    Each load first waits until earlier TMA stores have read ``state_s`` (a final state or dh0
    stored from it)."""
    out = []
    for j, x in enumerate(blocks):
        if j:  # every thread has read block j − 1 before TMA overwrites it
            plgpu.commit_smem()

        @pl.when(flag == 1)
        def _():
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.copy_gmem_to_smem(src_of(j), state_s, bar)
            plgpu.barrier_wait(bar)

        out.append(jnp.where(flag == 1, plgpu.load(state_s, layout=WGMMA), x))
    return tuple(out)


def stage_blocks(ref, blocks, kb: int):
    """Register tiles ``blocks`` (``[M, kb]`` each) into the columns of SMEM ``ref [M, n·kb]`` in
    ``ref``'s dtype, fenced once for the tensor cores and TMA; returns ``ref`` (:func:`stage`
    for a blocked tile)."""
    for j, x in enumerate(blocks):
        key_block(ref, j, kb)[...] = x.astype(ref.dtype)
    plgpu.commit_smem()
    return ref
