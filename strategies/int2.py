"""``int2``: KIVI 2-bit asymmetric K/V cache.

KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML), the
2-bit setting the paper is named after: keys per channel (groups of ``group_size`` tokens within one
channel), values per token (groups of ``group_size`` channels), float16 scale and zero point per group,
and KIVI's full-precision residual: the last ``T mod R`` keys and the ``R = residual_length`` newest
values (see ``int4`` for the shared scheme and the ``residual_layout`` option).

Codes are packed four per byte. Bits per quantized element: 2 + 2 * 16 / G = 3 at G = 32; exact
tokens cost 16 bits. At 4K context with G = 32, R = 128 that is an 80.0% reduction against 16 bits.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.strategies._quantstore import KiviStrategy


@dataclass
class Int2(KiviStrategy):
    """KIVI-2: 2-bit asymmetric codes, keys per channel, values per token, full-precision recent window."""

    name = "int2"
    bits = 2
