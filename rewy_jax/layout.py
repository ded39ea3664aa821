"""Token layout ``[B, T, H, D]`` <-> chunk layout ``[B, H, N, C, D]``, batched or variable-length.

A plain batch is padded at the end of T to a multiple of C. Variable-length input (B = 1, packed
sequences delimited by ``cu_seqlens``) is re-laid so that every sequence starts on a chunk
boundary; the chunk count is bounded statically by ``(T + n_seq·(C − 1)) / C`` so this works
under ``jit`` with traced offsets. Padding rows are zeros (k = e = z = 0, G = 0), which leave
the state unchanged, so results are exact. Both directions are gathers, differentiated by JAX.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp


class ChunkPlan(NamedTuple):
    """How tokens map to chunks, and the sequence metadata of ``xla_chunked``."""

    n_chunks: int
    chunk_size: int
    gather: jnp.ndarray | None  # [N·C] token index per chunk row (T = a zero row); None: plain pad
    scatter: jnp.ndarray | None  # [T] chunk-row index of each token; None: plain pad
    chunk_reset: jnp.ndarray  # [N] bool
    chunk_seq: jnp.ndarray  # [N] int32
    end_chunk: jnp.ndarray  # [n_seq] int32


def plan_chunks(T: int, chunk_size: int, cu_seqlens=None) -> ChunkPlan:
    C = chunk_size
    if cu_seqlens is None:
        N = -(-T // C)
        return ChunkPlan(
            n_chunks=N, chunk_size=C, gather=None, scatter=None,
            chunk_reset=jnp.arange(N) == 0,
            chunk_seq=jnp.zeros((N,), jnp.int32),
            end_chunk=jnp.full((1,), N - 1, jnp.int32))
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    n_seq = cu.shape[0] - 1
    N = (T + n_seq * (C - 1)) // C
    lens = cu[1:] - cu[:-1]
    n_ch = (lens + C - 1) // C
    ends = jnp.cumsum(n_ch)  # chunk after the last chunk of each sequence
    starts = ends - n_ch
    c = jnp.arange(N, dtype=jnp.int32)
    chunk_seq = jnp.searchsorted(ends, c, side="right").astype(jnp.int32)  # n_seq: padding
    seq_c = jnp.minimum(chunk_seq, n_seq - 1)
    chunk_reset = (chunk_seq >= n_seq) | (c == starts[seq_c])
    p = jnp.arange(N * C, dtype=jnp.int32)
    seq_p = chunk_seq[p // C]
    seq_pc = jnp.minimum(seq_p, n_seq - 1)
    offset = p - starts[seq_pc] * C
    valid = (seq_p < n_seq) & (offset < lens[seq_pc])
    gather = jnp.where(valid, cu[seq_pc] + offset, T)
    t = jnp.arange(T, dtype=jnp.int32)
    seq_t = jnp.searchsorted(cu[1:], t, side="right")
    scatter = starts[seq_t] * C + (t - cu[seq_t])
    return ChunkPlan(n_chunks=N, chunk_size=C, gather=gather, scatter=scatter,
                     chunk_reset=chunk_reset, chunk_seq=chunk_seq, end_chunk=ends - 1)


def to_chunks(x, plan: ChunkPlan):
    """[B, T, H, *D] -> [B, H, N, C, *D] (zero rows where padding)."""
    if x is None:
        return None
    B, T = x.shape[:2]
    N, C = plan.n_chunks, plan.chunk_size
    if plan.gather is None:
        pad = [(0, 0)] * x.ndim
        pad[1] = (0, N * C - T)
        x = jnp.pad(x, pad)
    else:
        x = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)[:, plan.gather]
    x = x.reshape((B, N, C) + x.shape[2:])
    return jnp.moveaxis(x, 3, 1)


def from_chunks(x, plan: ChunkPlan, T: int):
    """[B, H, N, C, D] -> [B, T, H, D]."""
    B, H, N, C = x.shape[:4]
    x = jnp.moveaxis(x, 1, 3).reshape((B, N * C, H) + x.shape[4:])
    return x[:, :T] if plan.scatter is None else x[:, plan.scatter]
