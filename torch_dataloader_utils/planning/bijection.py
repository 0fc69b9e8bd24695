"""Pure: the keyed bijection shuffled orders are made of, a random permutation of
``range(rows)`` from a 64-bit key, whole (``permutation``) or one position of it (``permuted``).

Four rounds of add-key, multiply by an odd constant and xor-shift permute the power of two
``2^k >= rows``; a value that lands past ``rows`` is permuted again until it does not (cycle
walking). Integer arithmetic of our own (splitmix64 for the round keys), so every platform and
numpy version computes the same permutation.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import numpy.typing as npt

from .plan import splitmix64

__all__ = [
    "permutation",
    "permuted",
    "permuted_by",
    "round_ints",
    "round_keys",
    "splitmix64_int",
    "walk",
]

# The bijection's multipliers (odd) and the rows it permutes at a time (fits the L2 cache).
_MULTIPLIERS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)
_CHUNK = 1 << 15
_MASK64 = 0xFFFFFFFFFFFFFFFF


def permutation(rows: int, key: int) -> npt.NDArray[np.uint32]:
    """A keyed random permutation of ``range(rows)``: position ``t`` delivers row ``out[t]``
    (``uint32``: a window's is held while the window is handed out, at 4 bytes a row).

    Four rounds of add-key, multiply by an odd constant and xor-shift permute the power of two
    ``2^k >= rows``; a value that lands past ``rows`` is permuted again until it does not
    (cycle walking), so ``out[t] == permuted(t, rows, key)``.
    """
    if rows <= 1:  # nothing to permute: no round keys
        return np.arange(rows, dtype=np.uint32)
    # the rounds' keys from Python ints (as ``permuted``): numpy on one key costs more; not
    # cached (a window's key is used once here: the cache holds the keys a state looks up)
    adds = [np.array(add, dtype=np.uint32) for add, _ in round_ints.__wrapped__(key)]
    if rows > _CHUNK:
        return walk(np.arange(rows, dtype=np.uint32), rows, adds)
    # a window of a few rows: the bijection of its whole power of two at once (fewer numpy
    # calls than walking the values past ``rows`` round by round), then walked by look-ups
    bits = (rows - 1).bit_length()
    image = _rounds(np.arange(1 << bits, dtype=np.uint32), bits, adds)
    out = image[:rows].copy()
    outside = np.flatnonzero(out >= rows)
    while len(outside):
        out[outside] = image[out[outside]]
        outside = outside[out[outside] >= rows]
    return out


def permuted(position: int, rows: int, key: int) -> int:
    """``permutation(rows, key)[position]`` without the rest: the same rounds on one Python
    int (a state names a row of every stream, and of every source of a mixture, per call)."""
    return permuted_by(position, rows, round_ints(key))


def permuted_by(position: int, rows: int, rounds: tuple[tuple[int, int], ...]) -> int:
    """``permuted`` with the rounds' keys given."""
    if rows <= 1:
        return position
    bits = (rows - 1).bit_length()
    mask, shift = (1 << bits) - 1, (bits + 1) // 2
    x = position
    while True:
        for add, multiplier in rounds:
            x = ((x + add) & mask) * multiplier & mask
            x ^= x >> shift
        if x < rows:
            return x


@lru_cache(maxsize=16384)
def round_ints(key: int) -> tuple[tuple[int, int], ...]:
    """``(add, multiplier)`` of each round keyed by ``key``, as Python ints (a state asks for
    the same keys, a window of each of its streams of each source, at every call)."""
    return tuple(
        (splitmix64_int(key + n) & 0xFFFFFFFF, multiplier)
        for n, multiplier in enumerate(_MULTIPLIERS)
    )


def round_keys(key: int | npt.NDArray[np.uint64]) -> list[npt.NDArray[np.uint32]]:
    """What each round of the bijection keyed by ``key`` (one, or one per value) adds."""
    keys = np.asarray(key, dtype=np.uint64)
    return [
        (splitmix64(keys + np.uint64(n)) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        for n in range(len(_MULTIPLIERS))
    ]


def walk(
    x: npt.NDArray[np.uint32], rows: int, adds: list[npt.NDArray[np.uint32]]
) -> npt.NDArray[np.uint32]:
    """The bijection of round keys ``adds`` applied to ``x`` (values below ``rows``) until
    each lands below ``rows``: ``_CHUNK`` values at a time, in cache, then the values still
    past ``rows`` all together (walking each chunk's few stragglers alone costs more)."""
    if rows <= 1:
        return x
    bits = int(rows - 1).bit_length()
    for first in range(0, len(x), _CHUNK):
        part = slice(first, first + _CHUNK)
        _rounds(x[part], bits, [a if a.ndim == 0 else a[part] for a in adds])
    outside = np.flatnonzero(x >= rows)
    while len(outside):
        x[outside] = _rounds(x[outside], bits, [a if a.ndim == 0 else a[outside] for a in adds])
        outside = outside[x[outside] >= rows]
    return x


def _rounds(
    x: npt.NDArray[np.uint32], bits: int, adds: list[npt.NDArray[np.uint32]]
) -> npt.NDArray[np.uint32]:
    """The rounds of the bijection on ``bits`` bits applied to ``x`` in place (returned)."""
    mask = np.uint32((1 << bits) - 1)
    shift = np.uint32((bits + 1) // 2)
    shifted = np.empty_like(x)
    for add, multiplier in zip(adds, _MULTIPLIERS, strict=True):
        x += add  # no mask before the product: its low bits depend on low bits only
        x *= np.uint32(multiplier)
        x &= mask
        np.right_shift(x, shift, out=shifted)
        x ^= shifted
    return x


def splitmix64_int(value: int) -> int:
    """``splitmix64`` of one Python int (modulo 2^64), in Python ints."""
    z = value * 0x9E3779B97F4A7C15 & _MASK64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & _MASK64
    return z ^ (z >> 31)
