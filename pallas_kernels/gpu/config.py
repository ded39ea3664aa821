"""The Pallas GPU kernels' settings: one frozen, validated :class:`KernelConfig` per call.

Every choice the kernels make that is not fixed by the math — tile widths, warps, pipeline
stages, what is stored in 16 bits, which of two measured forms a kernel takes — is a field
here. :func:`default_config` picks them for one call from (gate mode, K, V, dtype, whether
the call is one sequence per batch row) with the values measured on H100/H200
(docs/performance-log.md has what each alternative measured). The config travels with the
call (``api.Config.kernel``, a ``jax.custom_vjp`` static argument), so it is part of the jit
cache key: nothing is read from module state when a kernel is traced.

Override per call with the ops' ``kernel_config=`` keyword: a ``KernelConfig`` (used as is),
or a mapping of field overrides applied to the call's default, e.g.
``chunk_kda(..., backend="pallas_gpu", kernel_config={"block_v": 32})``. Tools build configs
the same way (``with_overrides``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax.numpy as jnp

GATE_MODES = ("none", "scalar", "vector")
# How vector-gate diagonal sub-chunk blocks are evaluated (blocks.DIAG_METHODS less
# "centred", which a declared gate bound selects per call).
DIAG_METHODS = ("loop", "levels", "outer")
# The backward's stored tensors that may be kept in bf16 between its kernels for 16-bit
# inputs: the recomputed chunk start states S0 [B,H,N,K,V] and residuals R [B,Tp,H,V],
# dS_end "dS" [B,H,N,K,V], dR and its state-free part "dRl" [B,Tp,H,V], Λ "lam" [B,Tp,H,V],
# W [B,Tp,H,K] and U [B,Tp,H,V] as re-formed in the backward, the inverse A [B,H,N,C,C] kept
# by the forward, and "dT": dT and dA_qk [B,H,N,C,C] between bwd_dlam and bwd_leaf.
LOW_PRECISION_NAMES = ("S0", "R", "dS", "dR", "dRl", "lam", "W", "U", "A", "dT")
# The forward's stored tensors that may be 16-bit: W, U (intra -> state pass) in the inputs'
# dtype, S0, R (state pass -> output) in bf16.
FORWARD_LOW_PRECISION_NAMES = ("W", "U", "S0", "R")
# Kernels with a warp count (pallas_call names less the "rewy_" prefix; "gates": cum_gates,
# gate_grad, decayed_rows).
KERNELS = ("intra", "wu", "qk_gram", "fwd_pass", "output", "bwd_local", "bwd_pass", "bwd_dlam",
           "bwd_leaf", "twin_pass", "gates")
# Software-pipeline stages of the state passes, by pass: "fwd" (the forward's unfused pass and
# the backward's recomputing one with TF32 products), "native" (the same with native bf16
# products), "fused" (the forward's pass forming the output, 16-bit W), "fused_w32" (16-bit
# inputs, fp32 W), "fused_f32" (fp32 inputs), "bwd" (the reverse pass), "twin" (twin_pass).
PASSES = ("fwd", "native", "fused", "fused_w32", "fused_f32", "bwd", "twin")


def _pow2(x):
    return isinstance(x, int) and x >= 16 and not x & (x - 1)


@dataclass(frozen=True)
class KernelConfig:
    """Settings of one call's kernels (hashable: a jit cache key). Fields by concern:

    Tiles: ``block_v`` value tile of the per-chunk output kernels (output, bwd_local,
    bwd_dlam's loop), ``block_k`` key tile of bwd_leaf, ``block_v_state`` value tile of the
    state passes — powers of two ≥ 16 (wider than the head dim: the head dim).

    Launch: ``warps`` ((kernel, n) for every name in KERNELS), ``stages`` ((pass, n) for every
    name in PASSES), ``tiles_first`` (launch the value/key-tile grid axis first, so that a
    chunk's tiles read their shared operands from L2 once).

    Precision: ``narrow_keys`` (16-bit calls with K ≤ it run the kernels on fp32 q, k, v),
    ``backward_low_precision`` / ``forward_low_precision`` (names of LOW_PRECISION_NAMES /
    FORWARD_LOW_PRECISION_NAMES stored in 16 bits for 16-bit inputs), ``*_native_pass_dots``
    (state passes multiply 16-bit stored operands natively), ``leaf_native_decayed``,
    ``tf32_emulation`` (interpret mode: the GPU's TF32 rounding emulated).

    Algorithm: the rest; each names the kernel it steers and is documented where it is read.

    Build one with ``default_config`` (and ``with_overrides``): the launch tables have no
    defaults of their own, so ``KernelConfig()`` alone is refused.
    """

    # tiles
    block_v: int = 64
    block_k: int = 64
    block_v_state: int = 32
    # launch
    warps: tuple = ()
    stages: tuple = ()
    tiles_first: bool = True
    # precision policy
    narrow_keys: int = 32
    backward_low_precision: tuple = LOW_PRECISION_NAMES
    forward_low_precision: tuple = ()
    forward_native_pass_dots: bool = True
    backward_native_pass_dots: bool = True
    leaf_native_decayed: bool = True
    # interpret mode only: None, or "truncate" / "round" — the TF32 rounding of the GPU's
    # DEFAULT-precision products emulated on fp32 operands (blocks.EmulatedTF32)
    tf32_emulation: str | None = None
    # forward
    row_scaled_ez: bool = True        # Ē = βe ⊙ k, Z = βz ⊙ v formed in-kernel (per-row β)
    gram_from_qk: bool = True         # vector gates: intra reads T from qk_gram
    intra_diag: str = "loop"
    intra_kslice: int = 64
    joint_diag_inverse: bool = True
    stacked_diag: bool = True
    gate_on_A: bool = True            # scalar gates: γ on A's columns in intra's W
    qk_gram_rowgrid: bool = True
    qk_gram_diag: str = "loop"
    qk_gram_kslice: int = 16
    qk_gram_centred: bool = True
    qk_gram_row_frames: bool = True
    fused_output: bool = True         # the recompute forward's output inside its state pass
    fwd_predecayed: bool = True       # vector gates: the fused pass reads K̄, Qγ
    one_seq_init: bool = True         # one-sequence passes start from h0 / dfin directly
    end_after_loop: bool = True       # ... and store the end state after the loop
    value_side_decay: bool = True     # scalar gates: row decays on the [C, BV] operand
    # backward
    keep_chunk_matrices: bool = True  # policy recompute: the forward keeps A (and P)
    twin_pass: bool = True            # the two backward state passes in one launch
    dlam_decays: bool = True          # scalar gates: bwd_dlam stores dT, dA_qk decayed
    leaf_rowgrid: bool = True         # vector gates: one leaf program per 16-row block
    leaf_diag: str = "levels"
    leaf_shared_decay: bool = True
    leaf_e_rows: bool = True          # ReWY: the leaf forms e = βe ⊙ k from k

    def __post_init__(self):
        bad = []
        for f in ("block_v", "block_k", "block_v_state"):
            if not _pow2(getattr(self, f)):
                bad.append(f"{f}={getattr(self, f)!r} must be a power of two ≥ 16")
        for f, names in (("warps", KERNELS), ("stages", PASSES)):
            table = getattr(self, f)
            keys = [k for k, _ in table]
            if sorted(keys) != sorted(names):
                bad.append(f"{f} must give every one of {names} once; got {keys}")
            bad += [f"{f}[{k!r}]={v!r} must be a positive int" for k, v in table
                    if not (isinstance(v, int) and v > 0)]
        for f in ("intra_diag", "qk_gram_diag", "leaf_diag"):
            if getattr(self, f) not in DIAG_METHODS:
                bad.append(f"{f}={getattr(self, f)!r} must be one of {DIAG_METHODS}")
        for f in ("intra_kslice", "qk_gram_kslice", "narrow_keys"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 0:
                bad.append(f"{f}={v!r} must be an int ≥ 0")
        for f, names in (("backward_low_precision", LOW_PRECISION_NAMES),
                         ("forward_low_precision", FORWARD_LOW_PRECISION_NAMES)):
            v = getattr(self, f)
            if not isinstance(v, tuple) or set(v) - set(names):
                bad.append(f"{f}={v!r} must be a tuple of some of {names}")
        if self.tf32_emulation not in (None, "truncate", "round"):
            bad.append(f"tf32_emulation={self.tf32_emulation!r} must be None, 'truncate' or "
                       "'round'")
        for f in dataclasses.fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                bad.append(f"{f.name}={getattr(self, f.name)!r} must be a bool")
        if bad:
            raise ValueError("KernelConfig: " + "; ".join(bad))

    def warp(self, kernel):
        """Warps of ``kernel`` (a name in KERNELS)."""
        return dict(self.warps)[kernel]

    def stage(self, which):
        """Pipeline stages of state pass ``which`` (a name in PASSES)."""
        return dict(self.stages)[which]

    def with_overrides(self, overrides):
        """A copy with ``overrides`` (field -> value; "warps" / "stages" may give a partial
        mapping that updates the table) — validated like any config."""
        kw = dict(overrides)
        for f in ("warps", "stages"):
            if f in kw and isinstance(kw[f], dict):
                kw[f] = tuple(sorted({**dict(getattr(self, f)), **kw[f]}.items()))
        unknown = set(kw) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"KernelConfig has no fields {sorted(unknown)}")
        return dataclasses.replace(self, **kw)


def default_config(mode, K, V, dtype, *, one_seq=True):
    """The measured defaults for one call: ``mode`` its gate mode ("none", "scalar",
    "vector"), K, V its head dims, ``dtype`` its inputs' dtype, ``one_seq`` False for packed
    variable-length inputs. The numbers are H100/H200 measurements (docs/performance-log.md);
    every kernel of the package reads its settings from the config this returns."""
    if mode not in GATE_MODES:
        raise ValueError(f"mode must be one of {GATE_MODES}; got {mode!r}")
    wide = K > 128
    sixteen = jnp.dtype(dtype).itemsize < 4
    # Warps (profile-21/22, device events): intra and wu at 2 (4 for vector gates' wu, and
    # at K > 128 where the state passes and intra spill at fewer); bwd_pass and bwd_leaf at 8
    # (most live tiles) except the leaf on 32-wide key tiles without scalar gates (4:
    # profile-11/15).
    warps = {"intra": 2, "wu": 2, "qk_gram": 2, "fwd_pass": 4, "output": 4, "bwd_local": 4,
             "bwd_pass": 8, "bwd_dlam": 4, "bwd_leaf": 8, "twin_pass": 4, "gates": 4}
    if mode == "vector":
        warps["wu"] = 4
    if wide:
        warps["intra"] = warps["wu"] = 4
    # bwd_leaf's key tile: 64, or 32 for V > 128 and for vector gates at K = V = 128 (the
    # decay maps' [16, BK] tiles: profile-11)
    block_k = min(K, 64 if V <= 128 and not (mode == "vector" and K == V == 128) else 32)
    if mode in ("none", "vector") and block_k == 32:
        warps["bwd_leaf"] = 4
    # Stages (ptxas shared memory, sm_90; profile-17/18/19): one-sequence passes as deep as
    # shared memory holds; varlen passes (an indirect h0 load per chunk) 3, the twin 1; at
    # K > 128 one everywhere.
    if wide:
        stages = dict.fromkeys(PASSES, 1)
    elif not one_seq:
        stages = dict.fromkeys(PASSES, 3)
        stages["twin"] = 1
    else:
        fwd = 2 if mode == "vector" else 3  # vector gates' [C, K] gate rows: 222 KB at 3
        stages = {"fwd": fwd, "native": fwd, "fused": 3, "fused_w32": 3, "fused_f32": 2,
                  "bwd": 2, "twin": 2}
    return KernelConfig(
        block_v=min(64, V), block_k=block_k, block_v_state=min(32, V),
        warps=tuple(sorted(warps.items())), stages=tuple(sorted(stages.items())),
        # K > 128: the forward's W, S0, R in 16 bits (the native pass; profile-18)
        forward_low_precision=("W", "S0", "R") if wide and sixteen else (),
        # K = 256: the fused pass holds one stage and measured slower (run h200-7), the twin
        # pass spills
        fused_output=not wide, twin_pass=not wide,
        # the leaf forms e from k for no and scalar gates (profile-23); vector gates not yet
        leaf_e_rows=mode != "vector")


def resolve(kernel_config, mode, K, V, dtype, *, one_seq=True):
    """The config a call runs: ``kernel_config`` None (the default), a KernelConfig (as is) or
    a mapping of field overrides on the default."""
    if isinstance(kernel_config, KernelConfig):
        return kernel_config
    cfg = default_config(mode, K, V, dtype, one_seq=one_seq)
    return cfg if kernel_config is None else cfg.with_overrides(kernel_config)
