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
        return _base_inv_freq(cfg.rope_local_theta, cfg.head_dim)
    inv = _llama3(cfg, _base_inv_freq(cfg.rope_theta, cfg.head_dim))
    if cfg.rope_linear_factor != 1.0:  # positions / factor, as transformers' "linear" type
        inv = (inv / np.float32(cfg.rope_linear_factor)).astype(np.float32)
    return inv


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
