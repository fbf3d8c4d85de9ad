"""Helpers of the ``tiered`` and ``quant_recompute`` strategies (not a strategy: the registry skips ``_`` files).

* :class:`DiskPacket` — tensors written into one memory-mapped file (``torch.from_file``) under
  ``kvbench.models.cache_dir()/"tiers"``, optionally evicted from the page cache, read back on
  demand, removed on :meth:`DiskPacket.close` (the directory with :class:`StoreDir`);
* :class:`HostPacket` — tensors moved to host memory (pinned when the run is on CUDA);
* :func:`quantize` — per-token or per-channel integer quantization at 8, 4 or 2 bits (:mod:`kvbench.quantizers`);
* :class:`StoreGroup` — the stores of one cache, so a store can prefetch its successor's blocks or
  share one per-step recomputation;
* :func:`run_profile`, :func:`modelled_transfer`, :func:`modelled_recompute` — the run's hardware
  profile and the cost models of
  :mod:`kvbench.hardware`, imported lazily and returning ``None`` where a figure is missing, so a
  profile with null figures never breaks a run (the modelled figure is simply not recorded).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from kvbench.errors import KVBenchError
from kvbench.quantizers import TokenChunk, quantize_asymmetric, quantize_int8

_ALIGN = 64  # byte alignment of each tensor inside a packet file (any dtype can be viewed from there)


def tiers_root() -> Path:
    """Parent directory of every store's spill files: ``<kvbench cache>/tiers``."""
    from kvbench.paths import cache_dir

    return cache_dir() / "tiers"


class StoreDir:
    """A private temporary directory for one store's disk tier, removed when closed or garbage-collected."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.path: Path | None = None
        self._finalizer: weakref.finalize | None = None

    def get(self) -> Path:
        if self.path is None:
            root = tiers_root()
            root.mkdir(parents=True, exist_ok=True)
            self.path = Path(tempfile.mkdtemp(prefix=self.prefix, dir=root))
            # Runs at close(), when this object is collected, or at interpreter exit — whichever is first.
            self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.path), True)
        return self.path

    def close(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self.path, self._finalizer = None, None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class HostPacket:
    """Tensors held in host memory: the first cold tier. Pinned on CUDA runs so reads can be asynchronous."""

    tier = "host"

    def __init__(self, tensors: Sequence[torch.Tensor], pin: bool) -> None:
        moved = [t.to("cpu", copy=True) for t in tensors]  # a copy even on CPU: never alias the caller's
        self.tensors = [t.pin_memory() for t in moved] if pin else moved
        self.nbytes = sum(_nbytes(t) for t in self.tensors)

    def read(self, device: torch.device) -> list[torch.Tensor]:
        """Copy into compute memory (over PCIe on a GPU; a memcpy on a CPU-only host)."""
        if device.type == "cpu":
            return [t.clone() for t in self.tensors]
        return [t.to(device, non_blocking=True) for t in self.tensors]

    def close(self) -> None:
        self.tensors = []


class DiskPacket:
    """Tensors written into one memory-mapped file; nothing of them stays in process memory.

    Written through a shared ``torch.from_file`` mapping; read back through a fresh mapping each time.
    With ``drop_page_cache`` the file is flushed (``fsync``) after writing and evicted from the OS page
    cache (``posix_fadvise(DONTNEED)``, as the hardware probe does) after every write and read, so the
    tier really holds no RAM between steps and every read really comes from the disk.
    """

    tier = "disk"

    def __init__(self, directory: Path, tensors: Sequence[torch.Tensor], drop_page_cache: bool) -> None:
        self.layout: list[tuple[int, torch.dtype, torch.Size]] = []
        total = 0
        for t in tensors:
            self.layout.append((total, t.dtype, t.shape))
            total += -(-_nbytes(t) // _ALIGN) * _ALIGN
        self.path = directory / f"{uuid.uuid4().hex}.kv"
        self.file_bytes = max(total, 1)
        self.drop_page_cache = drop_page_cache
        self._write(tensors)  # the mapping is gone when this returns: mapped pages cannot be evicted
        if drop_page_cache:
            self._evict(flush=True)
        self.nbytes = sum(_nbytes(t) for t in tensors)

    def _views(self) -> list[torch.Tensor]:
        buf = torch.from_file(str(self.path), shared=True, size=self.file_bytes, dtype=torch.uint8)
        return [buf[off:off + shape.numel() * dtype.itemsize].view(dtype).view(shape)
                for off, dtype, shape in self.layout]

    def _write(self, tensors: Sequence[torch.Tensor]) -> None:
        for view, t in zip(self._views(), tensors, strict=True):
            view.copy_(t.detach().to("cpu"))

    def _evict(self, flush: bool) -> None:
        if not hasattr(os, "posix_fadvise"):
            return
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if flush:  # dirty pages cannot be dropped: write them out first
                os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def read(self, device: torch.device) -> list[torch.Tensor]:
        """Read the file into compute memory through a mapping that is dropped again right after."""
        out = [v.to(device, copy=True) for v in self._views()]
        if self.drop_page_cache:
            self._evict(flush=False)
        return out

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


Packet = HostPacket | DiskPacket


def timed_read(packet: Packet, device: torch.device) -> tuple[list[torch.Tensor], float]:
    """Read ``packet`` and return the copies with the wall seconds the transfer really took."""
    start = time.perf_counter()
    out = packet.read(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return out, time.perf_counter() - start


# ---------------------------------------------------------------------------------------- quantization


def quantize(x: torch.Tensor, bits: int, group_size: int, axis: str = "token") -> TokenChunk:
    """Integer quantization at ``bits``: 8 is the symmetric int8 of :mod:`kvbench.quantizers`, 4 and 2 its
    asymmetric min/max format with codes packed ``8 // bits`` to a byte (KIVI's low-bit format).

    ``axis="token"``: groups of ``group_size`` channels within one token (tokens quantize on arrival; KIVI's
    value format); ``axis="channel"``: groups of ``group_size`` tokens within one channel (KIVI's key
    format, for keys' fixed outlier channels; needs a multiple of ``group_size`` tokens)."""
    if bits == 8:
        return quantize_int8(x, group_size, axis=axis)
    return quantize_asymmetric(x, bits, group_size, axis=axis)


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` in float32 (0 for an all-zero reference)."""
    ref = exact.float().norm()
    return 0.0 if ref == 0 else float((approx.float() - exact.float()).norm() / ref)


# ------------------------------------------------------------------------------------------ store groups


class StoreGroup:
    """The stores of one cache, in layer order (weak references: the group never keeps a store alive)."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._stores: list[weakref.ref] = []
        self.shared: dict[str, Any] = {}

    def add(self, store: Any) -> None:
        self._stores.append(weakref.ref(store))

    def __len__(self) -> int:
        return len(self._stores)

    def store(self, layer_idx: int) -> Any:
        """The live store of ``layer_idx``, or ``None``."""
        if 0 <= layer_idx < len(self._stores):
            return self._stores[layer_idx]()
        return None


def join_group(strategy: Any, store: Any) -> StoreGroup:
    """Attach ``store`` to the group of the cache being built (caches create their layers 0..n-1 in order)."""
    group: StoreGroup | None = getattr(strategy, "_store_group", None)
    if (store.layer_idx == 0 or group is None or group.num_layers != store.num_layers
            or len(group) != store.layer_idx):
        group = StoreGroup(store.num_layers)
        strategy._store_group = group
    group.add(store)
    return group


_PREFETCH: ThreadPoolExecutor | None = None


def prefetcher() -> ThreadPoolExecutor:
    """One background thread for all prefetches: reads of the next layer overlap this layer's compute."""
    global _PREFETCH
    if _PREFETCH is None:
        _PREFETCH = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvbench-prefetch")
    return _PREFETCH


# --------------------------------------------------------------------------------------- hardware models


@lru_cache(maxsize=1)
def _default_profile() -> Any:
    try:
        from kvbench.hardware import load_profile

        return load_profile("cpu")
    except (ImportError, KVBenchError, OSError):
        return None


def run_profile(strategy: Any) -> Any:
    """The bound run's hardware profile, else the shipped ``cpu`` profile, else ``None``."""
    context = getattr(strategy, "context", None)
    profile = getattr(context, "hardware", None)
    return profile if profile is not None else _default_profile()


def modelled_transfer(profile: Any, nbytes: float, link: str) -> float | None:
    """:func:`kvbench.hardware.modelled_transfer_seconds`, or ``None`` when the profile lacks the figure."""
    if profile is None:
        return None
    try:
        from kvbench.hardware import modelled_transfer_seconds

        return float(modelled_transfer_seconds(profile, nbytes, link))
    except (ImportError, KVBenchError):
        return None


def modelled_recompute(profile: Any, flops: float) -> float | None:
    """:func:`kvbench.hardware.modelled_recompute_seconds`, or ``None`` without a ``peak_flops`` figure."""
    if profile is None:
        return None
    try:
        from kvbench.hardware import modelled_recompute_seconds

        return float(modelled_recompute_seconds(profile, flops))
    except (ImportError, KVBenchError):
        return None
