"""``hf_quantized``: transformers' own quantized KV cache, run through the harness as an external reference.

transformers' ``QuantizedCache`` (``cache_implementation="quantized"``) implements a KIVI-like scheme
(Liu et al. 2024) on top of an external quantization backend: ``quanto`` (optimum-quanto's
``MaxOptimizer`` + ``quantize_weight``, 2 or 4 bits) or ``hqq`` (Badri & Shaji 2023, "Half-Quadratic
Quantization", 2/4/8 bits). Each of our layer stores wraps one of its layers
(``QuantoQuantizedLayer`` / ``HQQQuantizedLayer``) unchanged, so its exact behaviour is measured:

* the whole prefill is quantized at once (no residual at prefill);
* decoded tokens collect in a full-precision residual; when it reaches ``residual_length`` the whole
  cache is dequantized, concatenated and re-quantized (so older tokens are rounded repeatedly);
* groups of ``group_size`` contiguous elements along ``head_dim`` with ``axis=0`` (quanto) /
  ``axis=1`` (hqq); scale and zero point are kept in the model dtype (16 bits in bf16 runs).

Bytes are counted from what the backend really holds: the packed integer data and the scale/shift
tensors inside quanto's ``WeightQBitsTensor`` (walked through ``__tensor_flatten__``), or HQQ's packed
``uint8`` tensor and its ``meta`` scale/zero, plus the residual. A group wider than the head is clipped
to the head (as in every kvbench quantizer), so any token count is accepted.

Needs ``pip install --no-deps optimum-quanto`` or ``pip install --no-deps hqq termcolor`` (transformers
imports ``hqq`` whenever it is installed, and ``hqq`` imports ``termcolor``: without it, installing
``hqq`` breaks ``transformers.cache_utils`` altogether).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from kvbench.strategies.base import LayerCapture, LayerStore, Strategy, held_bytes, require

from kvbench.errors import KVBenchError

BACKENDS = {
    # backend: (valid nbits, valid axes, pip command). transformers also lets through quanto axis -1 and
    # HQQ 1/3 bits, but those fail for most token counts (quanto's groups then run across tokens; HQQ's
    # 1/3-bit packing needs row counts divisible by 8/10), so they are refused here with a clear message.
    "quanto": ((2, 4), (0,), "pip install --no-deps optimum-quanto"),
    "hqq": ((2, 4, 8), (0, 1), "pip install --no-deps hqq termcolor"),
}


def backend_available(backend: str) -> bool:
    """Exactly the checks transformers' layers make before using the backend."""
    from transformers.utils import is_hqq_available, is_optimum_quanto_available, is_quanto_greater

    if backend == "quanto":
        return bool(is_optimum_quanto_available() and is_quanto_greater("0.2.5", accept_dev=True))
    return bool(is_hqq_available())


def _leaf_tensors(obj: Any) -> list[torch.Tensor]:
    """Plain tensors behind a backend's quantized object (tensor subclasses, (tensor, meta) tuples)."""
    if isinstance(obj, torch.Tensor) and hasattr(obj, "__tensor_flatten__"):
        names, _ = obj.__tensor_flatten__()
        return [t for n in names for t in _leaf_tensors(getattr(obj, n))]
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _leaf_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _leaf_tensors(o)]
    return []


class HFQuantizedStore(LayerStore):
    """A transformers quantized cache layer behind the LayerStore interface."""

    strategy: HFQuantized

    def __init__(self, strategy: HFQuantized, layer_idx: int, num_layers: int) -> None:
        super().__init__(strategy, layer_idx, num_layers)
        self.layer: Any = None
        self.kv_shape: tuple[int, int, int] | None = None

    def _make_layer(self, head_dim: int) -> Any:
        from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

        s = self.strategy
        group = min(s.group_size, head_dim)
        if head_dim % group:
            raise KVBenchError(f"hf_quantized.group_size={s.group_size} must divide head_dim={head_dim}")
        cls = QuantoQuantizedLayer if s.backend == "quanto" else HQQQuantizedLayer
        return cls(nbits=s.nbits, axis_key=s.axis_key, axis_value=s.axis_value, q_group_size=group,
                   residual_length=s.residual_length)

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, capture: LayerCapture | None) -> None:
        b, h, _, d = keys.shape
        self.kv_shape = (b, h, d)
        self.layer = self._make_layer(d)
        self.layer.update(keys, values)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.layer is None:
            self.prefill(keys, values, None)
            return keys, values
        return self.layer.update(keys, values)

    def tensors(self) -> Iterable[torch.Tensor]:
        if self.layer is None:
            return []
        held = _leaf_tensors([self.layer._quantized_keys, self.layer._quantized_values])
        return held + [t for t in (self.layer.keys, self.layer.values) if isinstance(t, torch.Tensor)]

    def num_tokens(self) -> int:
        return 0 if self.layer is None else int(self.layer.cumulative_length)

    def stats(self) -> dict[str, float]:
        if self.kv_shape is None or self.num_tokens() == 0:
            return {}
        b, h, d = self.kv_shape
        residual = self.layer.keys.shape[-2] if self.layer.keys.dim() == 4 else 0
        return {"bits_per_element": 8 * held_bytes(self.tensors()) / (2 * b * h * d * self.num_tokens()),
                "quantized_fraction": 1 - residual / self.num_tokens()}


@dataclass
class HFQuantized(Strategy):
    """transformers' QuantizedCache layers (quanto or HQQ backend), measured like any kvbench strategy."""

    name = "hf_quantized"
    family = "reference"
    # quanto/HQQ tensor subclasses refuse deepcopy; caches are rebuilt from the capture (kvbench.engine.can_clone).
    cache_copyable = False
    backend: str = "quanto"
    nbits: int = 4
    group_size: int = 64
    residual_length: int = 128
    axis_key: int = 0
    axis_value: int = 0

    def validate(self) -> None:
        require(self.backend in BACKENDS,
                f"hf_quantized.backend must be one of {', '.join(BACKENDS)} (got {self.backend!r})")
        bits, axes, pip = BACKENDS[self.backend]
        require(self.nbits in bits, f"hf_quantized.nbits for backend {self.backend} must be one of "
                                    f"{', '.join(map(str, bits))} (got {self.nbits})")
        for which in ("axis_key", "axis_value"):
            require(getattr(self, which) in axes,
                    f"hf_quantized.{which} for backend {self.backend} must be one of "
                    f"{', '.join(map(str, axes))} (got {getattr(self, which)})")
        require(self.group_size in (8, 16, 32, 64, 128),
                f"hf_quantized.group_size must be one of 8, 16, 32, 64, 128 (got {self.group_size})")
        require(isinstance(self.residual_length, int) and self.residual_length >= 1,
                f"hf_quantized.residual_length must be an integer >= 1 (got {self.residual_length})")
        require(backend_available(self.backend),
                f"hf_quantized backend {self.backend!r} is not installed: run `{pip}`")

    def new_layer(self, layer_idx: int, num_layers: int) -> LayerStore:
        return HFQuantizedStore(self, layer_idx, num_layers)
