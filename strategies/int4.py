"""``int4``: KIVI 4-bit asymmetric K/V cache.

KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML):
keys are quantized per channel — groups of ``group_size`` consecutive tokens within one channel,
since key outliers sit in fixed channels — and values per token — groups of ``group_size`` channels
within one token. Each group has a float16 scale and zero point (``x̂ = code * scale + min``). KIVI's
full-precision residual (``residual_layout=kivi``, the default, as in ``jy-yuan/KIVI``
``models/llama_kivi.py``): the last ``T mod R`` keys (quantized all together once R have gathered) and
exactly the ``R = residual_length`` newest values (the oldest quantized as each new one arrives); a
decode step attends to its own tokens before quantizing them. ``residual_layout=window`` keeps R to
R + G - 1 newest tokens of both exact instead (see ``strategies/_quantstore.py``).

Codes are packed two per byte. Bits per quantized element: 4 + 2 * 16 / G = 5 at G = 32 (same for
keys and values); exact tokens cost 16 bits. At 4K context with the paper's G = 32, R = 128 that is a
67.7% reduction against a 16-bit cache (66.6% with ``residual_layout=window``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench.strategies._quantstore import KiviStrategy


@dataclass
class Int4(KiviStrategy):
    """KIVI-4: 4-bit asymmetric codes, keys per channel, values per token, full-precision recent window."""

    name = "int4"
    bits = 4
