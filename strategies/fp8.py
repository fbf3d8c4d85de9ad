"""``fp8``: K/V stored as 8-bit floating point (``float8_e4m3fn`` or ``float8_e5m2``).

The formats of Micikevicius et al. 2022 ("FP8 Formats for Deep Learning"): E4M3 (3 mantissa bits,
largest finite value 448, no infinities) and E5M2 (2 mantissa bits, range up to 57344). FP8 KV caches
are what vLLM and TensorRT-LLM ship, and transformers' ``Fp8QuantizedLayer``. Values are divided by a
float32 absmax scale so the largest one lands on the format's largest finite value:

* ``scale=tensor`` — one scale per layer for K and one for V;
* ``scale=channel`` — one scale per (batch, KV head, channel), i.e. ``[b, h, 1, head_dim]`` — keys
  have channel-wise outliers, which a single scale spends the format's range on.

Scales are calibrated once, on the prefill, and then fixed: decoded tokens are encoded with them and
*saturate* (clamp to ``±fmax * scale``) when they fall outside the prefill's range — E4M3 has no
infinity, so the clamp is also what keeps them finite. ``stats()`` reports the saturated fraction of
decoded elements. Nothing is ever re-quantized, so there is no full-precision residual and tokens can
be dropped exactly. Cost: 8 bits per element plus the (token-independent) scales.

Attention reads the payload block by block (``attend``). Only a dense reader (SDPA, eager attention) makes the
store keep its decoded K/V as harness scratch, unless the run context sets ``working_copy=False`` (see
``strategies/_quantstore.py``): each step then decodes only its new tokens, bit-identical to decoding all.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from kvbench.strategies._quantstore import ChunkList, WorkingCopy, working_copy_enabled
from kvbench.strategies.base import LayerCapture, LayerStore, Strategy, held_bytes, require

import kvbench.blockattn as blockattn
from kvbench.quantizers import FP8_FORMATS, FP8_SCALES, Fp8Quant, fp8_scale, gather_tokens, quantize_fp8


class Fp8Store(LayerStore):
    """One FP8 payload per tensor, grown by concatenation, with scales fixed at prefill."""

    strategy: Fp8

    def __init__(self, strategy: Fp8, layer_idx: int, num_layers: int) -> None:
        super().__init__(strategy, layer_idx, num_layers)
        self.kc, self.vc = ChunkList(), ChunkList()  # pieces: appending never copies the whole payload
        self.dtype: torch.dtype | None = None
        self.decoded_elements = 0
        self.saturated = 0
        self.work: tuple[WorkingCopy, WorkingCopy] | None = None

    @property
    def k(self) -> Fp8Quant | None:
        return self.kc.merged()  # type: ignore[return-value]

    @property
    def v(self) -> Fp8Quant | None:
        return self.vc.merged()  # type: ignore[return-value]

    def _ingest(self, keys: torch.Tensor, values: torch.Tensor, decoding: bool) -> None:
        self.dtype = keys.dtype
        fmt = self.strategy.format
        if not self.kc.pieces or not self.vc.pieces:
            if keys.shape[-2] == 0:
                return  # nothing to calibrate on yet: the first tokens to arrive set the scales
            ks, vs = fp8_scale(keys, fmt, self.strategy.scale), fp8_scale(values, fmt, self.strategy.scale)
            (k, _), (v, _) = quantize_fp8(keys, fmt, ks), quantize_fp8(values, fmt, vs)
        else:
            # Every piece carries the same (fixed) scale.
            scale_k, scale_v = self.kc.pieces[0].scale, self.vc.pieces[0].scale  # type: ignore[attr-defined]
            (k, sk), (v, sv) = quantize_fp8(keys, fmt, scale_k), quantize_fp8(values, fmt, scale_v)
            if decoding:
                self.decoded_elements += keys.numel() + values.numel()
                self.saturated += sk + sv
        self.kc.append(k)
        self.vc.append(v)
        self._keep(k, v)

    def _keep(self, k: Fp8Quant, v: Fp8Quant) -> None:
        """Decode only the new tokens into the working copy (if any)."""
        if self.work is not None:
            assert self.dtype is not None
            self.work[0].append(k.dequantize(self.dtype))
            self.work[1].append(v.dequantize(self.dtype))

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, capture: LayerCapture | None) -> None:
        self._ingest(keys, values, decoding=False)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._ingest(keys, values, decoding=True)
        assert self.k is not None and self.v is not None and self.dtype is not None
        if self.work is None and working_copy_enabled(self.strategy):
            # First dense read (SDPA or eager attention): from here on each step decodes only its new tokens.
            self.work = (WorkingCopy(), WorkingCopy())
            self.work[0].append(self.k.dequantize(self.dtype))
            self.work[1].append(self.v.dequantize(self.dtype))
        if self.work is not None:
            return self.work[0].view(), self.work[1].view()
        return self.k.dequantize(self.dtype), self.v.dequantize(self.dtype)

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
               scaling: float, softcap: float | None = None) -> torch.Tensor:
        """``LayerStore.attend`` over the FP8 payload, a block at a time, its scales folded into the products."""
        self._ingest(keys, values, decoding=True)
        heads = keys.shape[1]
        return blockattn.attend(query, blockattn.TokenRun(self.kc.pieces, heads),
                                blockattn.TokenRun(self.vc.pieces, heads), mask, scaling, softcap)

    def compact(self) -> None:
        """After a chunk of a chunked prefill: no reserved slots held (see ``ChunkList``)."""
        self.kc.seal()
        self.vc.seal()

    def select_tokens(self, index: torch.Tensor) -> None:
        """Exact: FP8 elements are independent and the scales do not depend on the tokens kept."""
        k, v = self.k, self.v
        if k is None or v is None:
            return  # nothing held yet
        self.kc.set(k.take(index))
        self.vc.set(v.take(index))
        if self.work is not None:
            for w in self.work:
                w.replace(gather_tokens(w.view(), index.to(w.view().device), -2))

    def tensors(self) -> Iterable[torch.Tensor]:
        return self.kc.tensors() + self.vc.tensors()

    def scratch_tensors(self) -> Iterable[torch.Tensor]:
        return [] if self.work is None else [t for w in self.work for t in w.tensors()]

    def num_tokens(self) -> int:
        return self.kc.num_tokens

    def stats(self) -> dict[str, float]:
        if self.k is None or self.num_tokens() == 0:
            return {}
        out = {"bits_per_element": 8 * held_bytes(self.tensors()) / (2 * self.k.payload.numel())}
        if self.decoded_elements:
            out["saturated_fraction"] = self.saturated / self.decoded_elements
        return out


@dataclass
class Fp8(Strategy):
    """FP8 cache (E4M3 or E5M2) with per-tensor or per-channel float32 scales fixed at prefill."""

    name = "fp8"
    family = "quantization"
    format: str = "e4m3"
    scale: str = "tensor"

    def validate(self) -> None:
        require(self.format in FP8_FORMATS,
                f"fp8.format must be one of {', '.join(FP8_FORMATS)} (got {self.format!r})")
        require(self.scale in FP8_SCALES,
                f"fp8.scale must be one of {', '.join(FP8_SCALES)} (got {self.scale!r})")

    def new_layer(self, layer_idx: int, num_layers: int) -> LayerStore:
        return Fp8Store(self, layer_idx, num_layers)
