"""Launching the Pallas GPU kernels: ``call`` (``pl.pallas_call`` with a config's warps,
stages and tile-first grid order) and ``Shape``, the static problem description every kernel
takes — sizes, gate mode, precision, the call's ``KernelConfig`` and the BlockSpecs of the
token layout.

Token layout throughout: ``[B, Tp, H, D]`` with Tp = N·C (padded by the caller); per-chunk
kernels take ``[C, D]`` blocks through BlockSpecs (grid (N, B·H[, tiles])), state passes take
one (batch, head) column ``[Tp, D]`` and slice chunk n with ``pl.ds(n·C, C)`` (grid (B·H,
V/BVs)). Gates: ``G`` is the chunk-local inclusive cumsum, ``[B, Tp, H]`` (scalar),
``[B, Tp, H, K]`` (vector) or None. Chunk matrices are ``[B, H, N, C, C]``, chunk states
``[B, H, N, K, V]``, initial / final states ``[B, H, n_seq + 1, K, V]`` (the extra slot absorbs
padding chunks). Sequence metadata (per chunk, int32 [N]): ``reset`` (start state is an initial
state), ``end`` (end state is a final state), ``seq`` (which initial/final slot).

q arrives unscaled and the op's scale multiplies the fp32 result of every product of q or dO
(``Shape.scaled``), so that q is not rounded to its 16-bit dtype a second time.
"""

from __future__ import annotations

import warnings

import jax
from jax.experimental import pallas as pl

from pallas_kernels.gpu.blocks import BS, F32
from pallas_kernels.gpu.config import KernelConfig
from pallas_kernels.vma import out_shapes_like


try:  # the Triton lowering's params; it warns that it is deprecated (design.md): silence here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from jax.experimental.pallas import triton as _plt
except ImportError:  # pragma: no cover
    _plt = None


def _compiler_params(num_warps, num_stages=None):
    if _plt is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def call(kernel, *, grid, in_specs, out_specs, out_shape, interpret, num_warps, name,
          num_stages=None, tile_axis=None):
    """``pl.pallas_call`` with the kernels' launch settings.

    tile_axis: None, or the grid axis that splits one (chunk or column, head) across several
    programs (value or key tiles), which all read the same per-chunk operands (q, k, W, ...),
    to be launched first (``Shape.tile_axis``: KernelConfig.tiles_first) — CUDA dispatches
    blockIdx.x fastest — so those programs run side by side and the operands come from L2
    once instead of from memory once per tile, on grids with more programs than the SMs hold
    at once. The specs and ``grid_id`` keep the logical axis order either way.
    """
    order = tuple(range(len(grid)))
    if tile_axis is not None:
        order = (tile_axis,) + tuple(a for a in order if a != tile_axis)
    def call(*args):
        # Under shard_map(check_vma=True) the outputs vary along the inputs' manual axes.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return pl.pallas_call(
                _launch_ordered(kernel, order), grid=tuple(grid[a] for a in order),
                in_specs=[_launch_spec(x, order) for x in in_specs],
                out_specs=([_launch_spec(x, order) for x in out_specs]
                           if isinstance(out_specs, (list, tuple))
                           else _launch_spec(out_specs, order)),
                out_shape=out_shapes_like(out_shape, *args),
                interpret=interpret, name=name,
                compiler_params=None if interpret else _compiler_params(num_warps, num_stages),
            )(*args)
    return call


_LAUNCH_ORDER: list = []  # launch position -> logical grid axis, of the kernel being traced


def _launch_ordered(kernel, order):
    def traced(*refs):
        _LAUNCH_ORDER.append(order)
        try:
            return kernel(*refs)
        finally:
            _LAUNCH_ORDER.pop()
    return traced


def _launch_spec(spec, order):
    """A BlockSpec written for the logical grid, on the launch grid ``order``."""
    if order == tuple(range(len(order))):
        return spec
    imap = spec.index_map

    def index_map(*launch_ids):
        ids = [None] * len(order)
        for pos, axis in enumerate(order):
            ids[axis] = launch_ids[pos]
        return imap(*ids)
    return pl.BlockSpec(spec.block_shape, index_map)


def grid_id(axis):
    """``pl.program_id`` of a logical grid axis (``call`` may launch the axes reordered)."""
    order = _LAUNCH_ORDER[-1] if _LAUNCH_ORDER else None
    return pl.program_id(order.index(axis) if order else axis)


class Shape:
    """Static problem description shared by the kernels, with the call's ``KernelConfig``
    (``cfg``: every setting a kernel reads)."""

    def __init__(self, B, Tp, H, K, V, C, n_seq1, mode, prec, cfg: KernelConfig,
                 centred=False, one_seq=False, scale=1.0):
        self.B, self.Tp, self.H, self.K, self.V, self.C = B, Tp, H, K, V, C
        self.cfg = cfg
        # the op's query scale (K^−½ by default), applied in-kernel: q arrives unscaled, so it
        # is not rounded a second time to its 16-bit dtype after the scaling (``scaled``)
        self.scale = float(scale)
        # one sequence per batch row (no cu_seqlens): chunk 0 resets to h0[:, :, 0] and chunk
        # N − 1 ends it, so the state passes start from h0 / dfin instead of selecting them at
        # every chunk (KernelConfig.one_seq_init)
        self.one_seq = one_seq
        # vector gates with a declared lower bound (blocks.CENTRED_MIN_GATE): diagonal sub-chunk
        # blocks of the leaf kernel as one centred matmul instead of exact per-pair work
        self.centred = centred
        self.N, self.n = Tp // C, C // BS
        self.n_seq1, self.mode, self.prec = n_seq1, mode, prec
        # tiles no wider than the head dims
        self.BV, self.BK, self.BVs = min(V, cfg.block_v), min(K, cfg.block_k), min(V, cfg.block_v_state)

    def scaled(self, x):
        """x · scale, for the fp32 result of a product with q or with dO: o = scale · (Qγ S0 +
        P R) and, in the backward, the cotangent scale · dO where dO meets q's side (P, Qγ) or
        the states (dO S0ᵀ, dO Rᵀ) — the gradients of o = scale · f(q) at the unscaled q, with
        f the op at scale 1. The final state's cotangent is not scaled (it does not pass
        through q)."""
        return x if self.scale == 1.0 else x * self.scale

    def warps(self, kernel):
        """Warps of ``kernel`` (a name in config.KERNELS)."""
        return self.cfg.warp(kernel)

    def tile_axis(self, axis):
        """``call``'s tile_axis: ``axis`` when the config launches tile axes first, else None."""
        return axis if self.cfg.tiles_first else None

    @property
    def one_seq_init(self):
        """Whether the state passes start from h0 / dfin directly (one sequence per row)."""
        return self.one_seq and self.cfg.one_seq_init

    def dlam_decays(self):
        """Whether ``bwd_dlam`` stores the chunk cotangents already decayed, dT ⊙ D and dA_qk ⊙ D
        with D_rs = e^{G_r − G_s} (KernelConfig.dlam_decays; scalar gates only — a vector
        gate's decay is no [C, C] matrix)."""
        return self.mode == "scalar" and self.cfg.dlam_decays

    def value_side_decay(self):
        """Whether the state passes put a scalar gate's per-row decays on the [C, BVs]
        value-side operand of each product instead of the [C, K] key side
        (KernelConfig.value_side_decay; a vector gate's decay runs along K and cannot move)."""
        return self.mode == "scalar" and self.cfg.value_side_decay

    def leaf_e_rows(self):
        """Whether ``bwd_leaf`` forms e = βe ⊙ k itself (KernelConfig.leaf_e_rows) — never with
        vector gates' per-pair ("loop") diagonals, which read e's rows one token at a time."""
        loop_diag = self.mode == "vector" and not self.centred and self.cfg.leaf_diag == "loop"
        return self.cfg.leaf_e_rows and not loop_diag


    # BlockSpecs ---------------------------------------------------------------------------
    def chunk_tok(self, D):
        H = self.H
        return pl.BlockSpec((None, self.C, None, D), lambda n, bh: (bh // H, n, bh % H, 0))

    def chunk_tok_v(self, BV):  # grid (N, B·H, V/BV): one value tile
        H = self.H
        return pl.BlockSpec((None, self.C, None, BV), lambda n, bh, v: (bh // H, n, bh % H, v))

    def chunk_tok3(self, D):  # grid (N, B·H, V/BV), full feature dim
        H = self.H
        return pl.BlockSpec((None, self.C, None, D), lambda n, bh, v: (bh // H, n, bh % H, 0))

    def chunk_gate3(self):
        H = self.H
        if self.mode == "scalar":
            return pl.BlockSpec((None, self.C, None), lambda n, bh, v: (bh // H, n, bh % H))
        return self.chunk_tok3(self.K)

    def chunk_mat3(self, r, c):  # [B, H, N, r, c] on grid (N, B·H, V/BV)
        H = self.H
        return pl.BlockSpec((None, None, None, r, c), lambda n, bh, v: (bh // H, bh % H, n, 0, 0))

    def chunk_state_v(self, BV):  # [B, H, N, K, V] tile
        H = self.H
        return pl.BlockSpec((None, None, None, self.K, BV), lambda n, bh, v: (bh // H, bh % H, n, 0, v))

    def chunk_row(self):  # [B, Tp, H] per-row values (scalar gates, row scales)
        H = self.H
        return pl.BlockSpec((None, self.C, None), lambda n, bh: (bh // H, n, bh % H))

    def chunk_gate(self):
        H = self.H
        if self.mode == "scalar":
            return pl.BlockSpec((None, self.C, None), lambda n, bh: (bh // H, n, bh % H))
        return self.chunk_tok(self.K)

    def chunk_mat(self, r, c):  # [B, H, N, r, c]
        H = self.H
        return pl.BlockSpec((None, None, None, r, c), lambda n, bh: (bh // H, bh % H, n, 0, 0))

    def col_tok(self, D, tiled):
        H = self.H
        if tiled:
            return pl.BlockSpec((None, self.Tp, None, self.BVs), lambda bh, v: (bh // H, 0, bh % H, v))
        return pl.BlockSpec((None, self.Tp, None, D), lambda bh, v: (bh // H, 0, bh % H, 0))

    def col_gate(self):
        H = self.H
        if self.mode == "scalar":
            return pl.BlockSpec((None, self.Tp, None), lambda bh, v: (bh // H, 0, bh % H))
        return self.col_tok(self.K, False)

    def col_mats(self, r, c):  # [B, H, N, r, c], all chunks (state passes)
        H = self.H
        return pl.BlockSpec((None, None, self.N, r, c), lambda bh, v: (bh // H, bh % H, 0, 0, 0))

    def col_states(self, lead):  # [B, H, lead, K, V] tiled over V (state passes)
        H = self.H
        return pl.BlockSpec((None, None, lead, self.K, self.BVs), lambda bh, v: (bh // H, bh % H, 0, 0, v))

    def pass_outputs(self, dtypes=(F32, F32)):
        """out_specs/out_shape of both state passes: per-chunk states [B,H,N,K,V] and a token
        tensor [B,Tp,H,V] (in ``dtypes``), and the per-sequence end states [B,H,n_seq1,K,V]
        (fp32)."""
        K, V = self.K, self.V
        return dict(
            out_specs=[self.col_states(self.N), self.col_tok(V, True), self.col_states(self.n_seq1)],
            out_shape=[jax.ShapeDtypeStruct((self.B, self.H, self.N, K, V), dtypes[0]),
                       self.sds_tok(V, dtypes[1]),
                       jax.ShapeDtypeStruct((self.B, self.H, self.n_seq1, K, V), F32)])

    def col_meta(self):
        return pl.BlockSpec((self.N,), lambda bh, v: (0,))

    def sds_tok(self, D, dtype=F32):
        return jax.ShapeDtypeStruct((self.B, self.Tp, self.H, D), dtype)

    def sds_gate(self):
        if self.mode == "scalar":
            return jax.ShapeDtypeStruct((self.B, self.Tp, self.H), F32)
        return self.sds_tok(self.K)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------
def split_refs(refs, mode, n_in):
    refs = list(refs)
    if mode == "none":
        refs.insert(n_in - 1, None)
    return refs
