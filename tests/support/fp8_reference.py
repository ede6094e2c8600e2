"""Exact FP8 arithmetic shared by the blockwise and the MXFP8 emulation tests.

E4M3 / E5M2 codes and their values in Python integers and ``fractions.Fraction`` only (no
torch rounding), the saturating round-to-nearest-even cast both emulations use, exact
power-of-two logarithms, and the scaffolding of their sharded-cast tests: random shard cuts of
a flat tensor and simulated ranks as threads.

Not a test module; tests import it as ``tests.support.fp8_reference``.
"""

from __future__ import annotations

import bisect
import math
import random
import threading
from collections.abc import Callable
from fractions import Fraction

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
#: mantissa bits, exponent bias, largest finite code (sign bit clear)
FP8_FORMATS = {E4M3: (3, 7, 0x7E), E5M2: (2, 15, 0x7B)}


def top_code(fmt: torch.dtype) -> int:
    """The code of ``fmt``'s largest finite positive value."""
    return FP8_FORMATS[fmt][2]


def fp8_value(code: int, fmt: torch.dtype) -> Fraction:
    """The exact value of a positive (sign bit clear) finite FP8 code."""
    man, bias, _ = FP8_FORMATS[fmt]
    exp, frac = code >> man, code & ((1 << man) - 1)
    if exp == 0:
        return Fraction(frac) * Fraction(2) ** (1 - bias - man)
    return Fraction((1 << man) + frac) * Fraction(2) ** (exp - bias - man)


_POSITIVE: dict[torch.dtype, list[Fraction]] = {}


def positive_values(fmt: torch.dtype) -> list[Fraction]:
    """The values of codes ``0 .. top_code(fmt)``, ascending (the list index is the code)."""
    if fmt not in _POSITIVE:
        _POSITIVE[fmt] = [fp8_value(c, fmt) for c in range(top_code(fmt) + 1)]
    return _POSITIVE[fmt]


def ref_cast(x: float | Fraction, fmt: torch.dtype, negative: bool | None = None) -> int:
    """Round-nearest-even, saturating (``__NV_SATFINITE``) cast of a value to an FP8 code;
    NaN -> canonical 0x7F. ``negative`` gives the sign where ``x`` cannot (a Fraction of a
    negative zero); by default it is the sign of ``x``."""
    if isinstance(x, float) and math.isnan(x):
        return 0x7F
    if negative is None:
        negative = math.copysign(1.0, x) < 0 if isinstance(x, float) else x < 0
    sign = 0x80 if negative else 0
    values = positive_values(fmt)
    top = len(values) - 1
    if isinstance(x, float) and math.isinf(x):
        return sign | top
    a = abs(Fraction(x))
    if a >= values[-1]:
        return sign | top
    hi = bisect.bisect_left(values, a)
    if values[hi] == a:
        return sign | hi
    below, above = a - values[hi - 1], values[hi] - a
    if below < above or (below == above and (hi - 1) % 2 == 0):
        return sign | (hi - 1)
    return sign | hi


def floor_log2(v: Fraction) -> int:
    """The largest ``e`` with ``2^e <= v`` (``v > 0``), exactly."""
    e = v.numerator.bit_length() - v.denominator.bit_length()
    while Fraction(2) ** e > v:
        e -= 1
    while Fraction(2) ** (e + 1) <= v:
        e += 1
    return e


def ceil_log2(v: Fraction) -> int:
    """The smallest ``e`` with ``2^e >= v`` (``v > 0``), exactly."""
    e = v.numerator.bit_length() - v.denominator.bit_length()
    while Fraction(2) ** e < v:
        e += 1
    while Fraction(2) ** (e - 1) >= v:
        e -= 1
    return e


def random_cuts(numel: int, ranks: int, rng: random.Random) -> list[int]:
    """Shard boundaries ``[0, ..., numel]`` of a flat tensor over ``ranks`` ranks, cut at
    random offsets (empty shards possible)."""
    return [0, *sorted(rng.randrange(numel + 1) for _ in range(ranks - 1)), numel]


def run_as_threads(ranks: int, rank: Callable[[int], None]) -> None:
    """Run ``rank(i)`` for every rank ``i`` on its own thread (simulated ranks that meet in a
    threaded collective) and wait for all of them."""
    threads = [threading.Thread(target=rank, args=(i,)) for i in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
