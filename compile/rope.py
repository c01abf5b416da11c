"""RoPE inverse frequencies, computed as HF transformers does (float32; llama3 or linear
scaling; a second base for sliding layers)."""

from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig


def _base_inv_freq(theta: float, d: int) -> np.ndarray:
    exponents = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    return (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)


def rope_inv_freq(cfg: ModelConfig, sliding: bool = False) -> np.ndarray:
    """(head_dim / 2,) float32: ``1 / theta^(2i / head_dim)``, then llama3 scaling if set
    (from ``rope_scaling``'s parameters, or divided by ``rope_freq_factors``) and linear
    scaling (``rope_linear_factor``).  ``sliding``: for a sliding layer, whose base is
    ``rope_local_theta`` when set, unscaled."""
    if sliding and cfg.rope_local_theta:
        return _padded(cfg, _base_inv_freq(cfg.rope_local_theta, cfg.rotary_dim))
    inv = _llama3(cfg, _base_inv_freq(cfg.rope_theta, cfg.rotary_dim))
    if cfg.rope_linear_factor != 1.0:  # positions / factor, as transformers' "linear" type
        inv = (inv / np.float32(cfg.rope_linear_factor)).astype(np.float32)
    return _padded(cfg, inv)


def _padded(cfg: ModelConfig, inv: np.ndarray) -> np.ndarray:
    """Partial RoPE's (rotary_dim / 2,) frequencies, then 0 up to head_dim / 2: the kernels
    rotate the stored pair (i, i + head_dim / 2) by frequency i, and frequency 0 (cos 1, sin 0)
    passes the unrotated dimensions (:func:`qk_row_order`) unchanged."""
    return np.concatenate([inv, np.zeros(cfg.head_dim // 2 - inv.size, np.float32)])


def qk_row_order(cfg: ModelConfig) -> np.ndarray | None:
    """(head_dim,) the HF head dimension each stored Q / K row holds, or None (every dimension
    rotates: HF's order).  HF's partial RoPE rotates pairs (i, i + rotary_dim / 2) of the first
    rotary_dim dimensions; stored at (i, i + head_dim / 2), the RoPE kernels' pairs, with the
    unrotated dimensions in the pairs of frequency 0, q . k is unchanged."""
    d, r = cfg.head_dim, cfg.rotary_dim
    if r == d:
        return None
    half, rest = d // 2, np.arange(r, d)
    return np.concatenate([np.arange(r // 2), rest[:half - r // 2], np.arange(r // 2, r),
                           rest[half - r // 2:]])


def qk_row_scale(cfg: ModelConfig) -> np.ndarray | None:
    """(head_dim,) factor of each stored Q / K row, or None (all 1): the rotated rows times
    ``rope_attn_factor`` (longrope scales cos and sin of the rotated dimensions by it)."""
    if cfg.rope_attn_factor == 1:
        return None
    scale = np.ones(cfg.head_dim, np.float32)
    half, r = cfg.head_dim // 2, cfg.rotary_dim // 2
    scale[:r] = scale[half:half + r] = np.float32(cfg.rope_attn_factor)
    return scale


def _llama3(cfg: ModelConfig, inv: np.ndarray) -> np.ndarray:
    if cfg.rope_freq_factors is not None:  # as llama.cpp applies a rope_freqs tensor
        return (inv / np.asarray(cfg.rope_freq_factors, np.float32)).astype(np.float32)
    s = cfg.rope_scaling
    if s is None:
        return inv
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)
