"""ggml's reference k-quant quantizers (``quantize_row_q4_K_ref``, ``q5_K_ref``, ``q6_K_ref`` of
ggml-quants.c, what llama-quantize runs without an importance matrix), written out as scalar
loops over numpy float32 values: one rounding per C operation, in C's order. The independent
reference the compiled quantizer (``compile/kquant.py``) is checked against byte for byte; slow,
so only for a few super-blocks."""

from __future__ import annotations

import numpy as np

F = np.float32


def nearest_int(v) -> int:
    return int(np.rint(v))  # ggml's magic-number rounding: to nearest, ties to even


def make_qkx2_quants(x, w, nmax: int, rmin: float, rdelta: float, nstep: int):
    """-> (scale, the_min, L): x ~ scale * L - the_min."""
    n = len(x)
    mn, mx = x[0], x[0]
    sum_w = w[0]
    sum_x = F(sum_w * x[0])
    for i in range(1, n):
        mn = x[i] if x[i] < mn else mn
        mx = x[i] if x[i] > mx else mx
        sum_w = F(sum_w + w[i])
        sum_x = F(sum_x + F(w[i] * x[i]))
    if mn > 0:
        mn = F(0)
    if mx == mn:
        return F(0), F(-mn), [0] * n
    iscale = F(F(nmax) / F(mx - mn))
    scale = F(F(1) / iscale)
    L = [min(max(nearest_int(F(iscale * F(x[i] - mn))), 0), nmax) for i in range(n)]
    best = F(0)
    for i in range(n):
        diff = F(F(F(scale * F(L[i])) + mn) - x[i])
        best = F(best + F(w[i] * F(diff * diff)))
    for step in range(nstep + 1):
        iscale = F(F(F(F(rmin) + F(F(rdelta) * F(step))) + F(nmax)) / F(mx - mn))
        aux = [min(max(nearest_int(F(iscale * F(x[i] - mn))), 0), nmax) for i in range(n)]
        sum_l = sum_l2 = sum_xl = F(0)
        for i in range(n):
            wl = F(w[i] * F(aux[i]))
            sum_l = F(sum_l + wl)
            sum_l2 = F(sum_l2 + F(wl * F(aux[i])))
            sum_xl = F(sum_xl + F(wl * x[i]))
        D = F(F(sum_w * sum_l2) - F(sum_l * sum_l))
        if D > 0:
            this_scale = F(F(F(sum_w * sum_xl) - F(sum_x * sum_l)) / D)
            this_min = F(F(F(sum_l2 * sum_x) - F(sum_l * sum_xl)) / D)
            if this_min > 0:
                this_min = F(0)
                this_scale = F(sum_xl / sum_l2)
            err = F(0)
            for i in range(n):
                diff = F(F(F(this_scale * F(aux[i])) + this_min) - x[i])
                err = F(err + F(w[i] * F(diff * diff)))
            if err < best:
                L, best, scale, mn = aux, err, this_scale, this_min
    return scale, F(-mn), L


def make_qx_quants_rmse1(x, nmax: int):
    """``make_qx_quants(n, nmax, x, L, 1, NULL)`` -> (scale, L + nmax)."""
    n = len(x)
    amax = mx = F(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = F(abs(v)), v
    if amax < F(1e-15):
        return F(0), [0] * n

    def quants(iscale):
        return [max(-nmax, min(nmax - 1, nearest_int(F(iscale * v)))) for v in x]

    def sums(q):
        sumlx = suml2 = F(0)
        for v, l in zip(x, q):
            wt = F(v * v)
            sumlx = F(sumlx + F(F(wt * v) * F(l)))
            suml2 = F(suml2 + F(F(wt * F(l)) * F(l)))
        return sumlx, suml2

    L = quants(F(F(-nmax) / mx))
    sumlx, suml2 = sums(L)
    scale = F(sumlx / suml2) if suml2 else F(0)
    best = F(scale * sumlx)
    for step in range(-9, 10):
        if step == 0:
            continue
        q = quants(F(F(-F(F(nmax) + F(F(0.1) * F(step)))) / mx))
        sumlx, suml2 = sums(q)
        if suml2 > 0 and F(sumlx * sumlx) > F(best * suml2):
            L, scale = q, F(sumlx / suml2)
            best = F(scale * sumlx)
    return scale, [l + nmax for l in L]


def _f16(v) -> np.float16:
    return np.float16(F(v))


def _kmin_block(x, bits: int) -> bytes:
    nmax = (1 << bits) - 1
    rmin, rdelta, nstep = (-1.0, 0.1, 20) if bits == 4 else (-0.5, 0.1, 15)
    scales, mins, L = [], [], []
    for j in range(8):
        xs = x[32 * j:32 * j + 32]
        sum_x2 = F(0)
        for v in xs:
            sum_x2 = F(sum_x2 + F(v * v))
        av_x = F(np.sqrt(F(sum_x2 / F(32))))
        w = [F(av_x + F(abs(v))) for v in xs]
        s, m, q = make_qkx2_quants(xs, w, nmax, rmin, rdelta, nstep)
        scales.append(s)
        mins.append(m)
        L.extend(q)
    max_scale = max([F(0)] + [s for s in scales if s > 0])
    max_min = max([F(0)] + [m for m in mins if m > 0])
    inv_scale = F(F(63) / max_scale) if max_scale > 0 else F(0)
    inv_min = F(F(63) / max_min) if max_min > 0 else F(0)
    ls = [min(63, nearest_int(F(inv_scale * s)) & 255) for s in scales]
    lm = [min(63, nearest_int(F(inv_min * m)) & 255) for m in mins]
    packed = [0] * 12
    for j in range(8):
        if j < 4:
            packed[j], packed[j + 4] = ls[j], lm[j]
        else:
            packed[j + 4] = (ls[j] & 15) | ((lm[j] & 15) << 4)
            packed[j - 4] |= (ls[j] >> 4) << 6
            packed[j] |= (lm[j] >> 4) << 6
    d, dmin = _f16(F(max_scale / F(63))), _f16(F(max_min / F(63)))
    for j in range(8):
        step = F(F(d) * F(ls[j]))
        if not step:
            continue
        off = F(F(dmin) * F(lm[j]))
        for i in range(32):
            L[32 * j + i] = min(max(nearest_int(F(F(x[32 * j + i] + off) / step)), 0), nmax)
    out = bytearray(np.array([d, dmin], np.float16).tobytes()) + bytes(packed)
    if bits == 5:
        qh = [0] * 32
        for j in range(8):
            for i in range(32):
                qh[i] |= (L[32 * j + i] >> 4) << j
        out += bytes(qh)
    for j in range(0, 256, 64):
        out += bytes((L[j + i] & 15) | ((L[j + i + 32] & 15) << 4) for i in range(32))
    return bytes(out)


def _q6k_block(x) -> bytes:
    scales, L = [], []
    for j in range(16):
        s, q = make_qx_quants_rmse1(x[16 * j:16 * j + 16], 32)
        scales.append(s)
        L.extend(q)
    max_abs, max_scale = F(0), F(0)
    for s in scales:
        if abs(s) > max_abs:
            max_abs, max_scale = F(abs(s)), s
    if max_abs < F(1e-15):
        return bytes(210)
    iscale = F(F(-128) / max_scale)
    d = _f16(F(F(1) / iscale))
    sc = [min(127, nearest_int(F(iscale * s))) for s in scales]
    for j in range(16):
        step = F(F(d) * F(sc[j]))
        if not step:
            continue
        for i in range(16):
            L[16 * j + i] = max(-32, min(31, nearest_int(F(x[16 * j + i] / step)))) + 32
    ql, qh = [], []
    for j in range(0, 256, 128):
        lo, hi = [0] * 64, [0] * 32
        for i in range(32):
            q1, q2, q3, q4 = (L[j + i + 32 * k] for k in range(4))
            lo[i] = (q1 & 15) | ((q3 & 15) << 4)
            lo[i + 32] = (q2 & 15) | ((q4 & 15) << 4)
            hi[i] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)
        ql += lo
        qh += hi
    return bytes(ql) + bytes(qh) + np.array(sc, np.int8).tobytes() + np.float16(d).tobytes()


def quantize(w: np.ndarray, fmt: str) -> np.ndarray:
    """Rows of w (n, K), K a multiple of 256 -> (n, K / 256 * block bytes) uint8."""
    block = {"q4_k": lambda x: _kmin_block(x, 4), "q5_k": lambda x: _kmin_block(x, 5),
             "q6_k": _q6k_block}[fmt]
    flat = np.asarray(w, F).reshape(-1, 256)
    out = b"".join(block([F(v) for v in row]) for row in flat)
    return np.frombuffer(out, np.uint8).reshape(w.shape[0], -1)
