"""``int8``: 8-bit integer K/V storage with float16 scales.

Symmetric round-to-nearest quantization (the int8 baseline of LLM.int8, Dettmers et al. 2022, and of
KVQuant, Hooper et al. 2024), one float16 absmax scale per group of ``group_size`` elements:

* ``axis=token`` (default) — groups of channels within one token, so every token is quantized on its
  own the moment it arrives: no full-precision residual is ever held. With the default
  ``group_size = 64`` (one group per head for a 64-dim head; a group wider than the head is clipped to
  the head) this costs 8 + 16/64 = 8.25 bits per element, a 48.4% reduction against a 16-bit cache.
* ``axis=channel`` — groups of ``group_size`` consecutive tokens within one channel (KIVI's key
  layout, Liu et al. 2024): one scale per channel per token group, 8 + 16/G bits per element. Tokens
  that do not fill a group yet (fewer than ``group_size``) wait in a full-precision residual and are
  quantized together once it fills.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvbench.strategies._quantstore import GROUP_SIZES, QuantizedStore, channel_group
from kvbench.strategies.base import LayerStore, Strategy, require

from kvbench.quantizers import AXES, SymmetricInt8, TokenChunk, quantize_int8


class Int8Store(QuantizedStore):
    """Token axis: every token quantized on arrival; channel axis: a group of tokens at a time."""

    strategy: Int8

    def __init__(self, strategy: Int8, layer_idx: int, num_layers: int) -> None:
        multiple = strategy.group_size if strategy.axis == "channel" else 1
        super().__init__(strategy, layer_idx, num_layers, residual=0, multiple=multiple)
        # Token axis: a token's codes are quantize_int8's of that token alone, which SymmetricInt8.write gives.
        self.tail_writes = strategy.axis == "token"

    def _encode(self, x: torch.Tensor) -> TokenChunk:
        if self.strategy.axis == "channel":
            return quantize_int8(x, self.strategy.group_size, "channel")
        group = channel_group(self.strategy.group_size, x.shape[-1], "int8.group_size")
        return quantize_int8(x, group, "token")

    def encode_keys(self, x: torch.Tensor) -> TokenChunk:
        return self._encode(x)

    def encode_values(self, x: torch.Tensor) -> TokenChunk:
        return self._encode(x)

    @property
    def k(self) -> list[SymmetricInt8]:
        """The quantized key chunks (one contiguous chunk once anything is quantized)."""
        return [] if self.qk is None else [self.qk]  # type: ignore[list-item]

    @property
    def v(self) -> list[SymmetricInt8]:
        return [] if self.qv is None else [self.qv]  # type: ignore[list-item]


@dataclass
class Int8(Strategy):
    """8-bit symmetric integer cache; groups of ``group_size`` channels per token, or tokens per channel."""

    name = "int8"
    family = "quantization"
    group_size: int = 64
    axis: str = "token"

    def validate(self) -> None:
        require(self.group_size in GROUP_SIZES,
                f"int8.group_size must be one of {', '.join(map(str, GROUP_SIZES))} (got {self.group_size})")
        require(self.axis in AXES, f"int8.axis must be one of {', '.join(AXES)} (got {self.axis!r})")

    def new_layer(self, layer_idx: int, num_layers: int) -> LayerStore:
        return Int8Store(self, layer_idx, num_layers)
