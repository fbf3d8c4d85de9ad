"""Integer quantizers shared by the quantization strategies.

Grouping convention: a tensor ``[..., tokens, head_dim]`` is cut into groups of ``group_size``
consecutive elements along one axis — ``axis="token"`` groups run along ``head_dim`` within one
token (one scale per token per group of channels, so new tokens quantize independently during
decoding); ``axis="channel"`` groups run along the token axis within one channel (KIVI's choice for
keys, whose outliers live in fixed channels). Scales (and zero points) are stored in float16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.errors import KVBenchError

SCALE_DTYPE = torch.float16


def check_finite(x: torch.Tensor) -> None:
    if not torch.isfinite(x).all():
        raise KVBenchError("cannot quantize a tensor containing NaN or inf")


def _to_groups(x: torch.Tensor, group_size: int, axis: str) -> torch.Tensor:
    """View ``x`` as ``[..., n_groups, group_size]`` along the requested axis (copies only for channel axis)."""
    if axis == "token":
        d = x.shape[-1]
        if d % group_size:
            raise KVBenchError(f"group_size={group_size} must divide head_dim={d}")
        return x.reshape(*x.shape[:-1], d // group_size, group_size)
    if axis == "channel":
        t = x.shape[-2]
        if t % group_size:
            raise KVBenchError(f"channel-axis groups need a token count divisible by group_size={group_size}")
        xt = x.transpose(-1, -2)  # [..., D, T]
        return xt.reshape(*xt.shape[:-1], t // group_size, group_size)
    raise KVBenchError(f"unknown quantization axis {axis!r}; valid: token, channel")


def _from_groups(g: torch.Tensor, shape: torch.Size, axis: str) -> torch.Tensor:
    if axis == "token":
        return g.reshape(shape)
    xt = g.reshape(*shape[:-2], shape[-1], shape[-2])
    return xt.transpose(-1, -2)


@dataclass
class SymmetricInt8:
    """Symmetric int8 codes with one float16 absmax scale per group."""

    codes: torch.Tensor  # int8, same shape as the input
    scales: torch.Tensor  # float16, [..., n_groups, 1] in grouped layout
    axis: str
    group_size: int

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        g = _to_groups(self.codes, self.group_size, self.axis).to(dtype)
        return _from_groups(g * self.scales.to(dtype), self.codes.shape, self.axis)

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scales]


def quantize_int8(x: torch.Tensor, group_size: int, axis: str = "token") -> SymmetricInt8:
    """Round-to-nearest symmetric int8: ``code = round(x / s)``, ``s = absmax / 127`` per group."""
    check_finite(x)
    g = _to_groups(x, group_size, axis).float()
    # Codes are computed against the float16 scale actually stored, so |x - x_hat| <= scale / 2.
    scale = (g.abs().amax(dim=-1, keepdim=True) / 127.0).to(SCALE_DTYPE)
    s = scale.float()
    # Groups of zeros keep scale 0 and code 0; dividing by 1 there avoids 0/0.
    codes = torch.round(g / torch.where(s > 0, s, torch.ones_like(s))).clamp_(-127, 127)
    codes = _from_groups(codes.to(torch.int8), x.shape, axis).contiguous()
    return SymmetricInt8(codes, scale, axis, group_size)
