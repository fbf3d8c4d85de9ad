"""``int4``: KIVI 4-bit asymmetric K/V cache.

KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML):
keys are quantized per channel — groups of ``group_size`` consecutive tokens within one channel,
since key outliers sit in fixed channels — and values per token — groups of ``group_size`` channels
within one token. Each group has a float16 scale and zero point (``x̂ = code * scale + min``). The
``residual_length`` most recent tokens stay in full precision; during decoding, whenever the residual
exceeds ``residual_length`` by a whole group, its oldest ``group_size`` tokens are quantized.

Codes are packed two per byte. Bits per quantized element: 4 + 2 * 16 / G = 5 at G = 32 (same for
keys and values); residual tokens cost 16 bits. At 4K context with the paper's G = 32, R = 128 that
is a 66.6% reduction against a 16-bit cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from strategies._quantstore import KiviStrategy


@dataclass
class Int4(KiviStrategy):
    """KIVI-4: 4-bit asymmetric codes, keys per channel, values per token, full-precision recent window."""

    name = "int4"
    bits = 4
