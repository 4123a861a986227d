"""Fits the polynomials of `exec/src/vmath.rs`'s vectorised erf and checks them.

erf(x) = x + x*q(x^2) for |x| <= 0.921875 (q of degree 6), and erf(t) = 1 - exp(r(t)) above it,
r of degree 8 fitted to ln(erfc(t)) on [0.921875, 4] (erf is 1 in f32 from 3.92 on). Each fit is a
least-squares fit on Chebyshev points, weighted (by erfc for r) and then reweighted towards the
minimax polynomial; the coefficients are rounded to f32 and the result is evaluated as the Rust
code does it (f32 Horner steps with a fused multiply-add, emulated by rounding a float64 product
and sum once), against Python's math.erf, over 300,000 points of [0, 4.5]. Prints the largest
error in units in the last place of the f32 result (1.02 when the coefficients were made,
2026-12-06) and the coefficients, lowest power first.

Rerun: pip install numpy; python3 exec/testdata/erf_fit.py
"""
import math

import numpy as np

f32 = np.float32
C = 0.921875  # the branch point


def fit_small(deg):
    s = (np.cos(np.linspace(0, math.pi, 4000)) + 1) / 2 * C * C
    x = np.sqrt(s)
    x[x == 0] = 1e-9
    y = np.array([math.erf(v) / v - 1 for v in x])
    V = np.vander(s, deg + 1, increasing=True)
    c, *_ = np.linalg.lstsq(V, y, rcond=None)
    w = np.ones_like(s)
    for _ in range(30):
        e = V @ c - y
        w = w * np.abs(e) ** 0.5
        w /= w.mean()
        c, *_ = np.linalg.lstsq(V * w[:, None], y * w, rcond=None)
    return c


def fit_big(deg, top=4.0):
    t = C + (np.cos(np.linspace(0, math.pi, 4000)) + 1) / 2 * (top - C)
    y = np.array([math.log(math.erfc(v)) for v in t])
    wt = np.array([math.erfc(v) for v in t])
    V = np.vander(t, deg + 1, increasing=True)
    c, *_ = np.linalg.lstsq(V * wt[:, None], y * wt, rcond=None)
    w = wt.copy()
    for _ in range(30):
        e = (V @ c - y) * wt
        w = w * np.abs(e) ** 0.5
        w /= w.mean()
        c, *_ = np.linalg.lstsq(V * w[:, None], y * w, rcond=None)
    return c


def fma(a, b, c):
    return f32(np.float64(a) * np.float64(b) + np.float64(c))


def horner(cc, x):
    r = cc[-1]
    for v in cc[-2::-1]:
        r = fma(r, x, v)
    return r


small = [f32(v) for v in fit_small(6)]
big = [f32(v) for v in fit_big(8)]


def erf32(a):
    a = f32(a)
    t = f32(abs(a))
    if t > f32(C):
        r = horner(big, min(t, f32(4.0)))
        return math.copysign(float(f32(1.0) - f32(math.exp(float(r)))), float(a))
    return float(fma(horner(small, f32(a * a)), a, a))


worst, at = 0.0, 0.0
for x in np.linspace(0, 4.5, 300001).astype(np.float32)[1:]:
    want = math.erf(float(x))
    err = abs(erf32(x) - want) / float(np.spacing(np.float32(want)))
    if err > worst:
        worst, at = err, float(x)
print(f"largest error {worst:.3f} ulp, at {at}")
print("ERF_SMALL", ", ".join(repr(float(v)) for v in small))
print("ERF_BIG", ", ".join(repr(float(v)) for v in big))
