"""Hardware profiles (the ``hardware=`` config group) and tiny cost models.

A profile describes one machine class: which torch device and dtype to run on, how much memory
the KV cache and weights may share, and four throughput figures that strategies use to *model*
costs they cannot measure on the machine at hand (tiered caches, recomputation):

* ``device_mem_bw_gbps`` — device-memory bandwidth, counted as bus traffic (a copy of N bytes
  moves 2N: read + write), the convention of vendor datasheets and of STREAM;
* ``host_link_bw_gbps`` — one-direction bandwidth of the host<->device link (PCIe); ``null`` on a
  CPU-only host, where the device memory *is* host memory;
* ``disk_bw_gbps`` — the spill tier (NVMe);
* ``peak_flops`` — dense matmul throughput in the profile's dtype.

All bandwidths are decimal GB/s (1e9 bytes per second). Shipped GPU profiles carry datasheet
peaks, so times modelled from them are lower bounds; ``cpu.yaml`` carries figures measured by
``kvbench hardware probe`` on the host the project runs on.

``kvbench hardware probe [--out PATH]`` measures the machine it runs on and writes a profile;
``kvbench hardware list`` prints the shipped profiles (both in :mod:`kvbench.hardware_probe`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from kvbench.errors import KVBenchError
from kvbench.paths import conf_dir

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
LINKS = {"device": "device_mem_bw_gbps", "host": "host_link_bw_gbps", "disk": "disk_bw_gbps"}
GB = 1e9



def hardware_dir() -> Path:
    """Where the ``hardware=`` profiles live."""
    return conf_dir() / "hardware"


def available_profiles() -> list[str]:
    """Names of the shipped profiles (file stems under :func:`hardware_dir`), sorted."""
    return sorted(p.stem for p in hardware_dir().glob("*.yaml"))


@dataclass(frozen=True)
class HardwareProfile:
    """One machine class; field names and units are those of ``conf/hardware/*.yaml``."""

    name: str
    device: str
    dtype: str
    memory_bytes: int
    threads: int | None = None
    simulate: bool = False
    device_mem_bw_gbps: float | None = None
    host_link_bw_gbps: float | None = None
    disk_bw_gbps: float | None = None
    peak_flops: float | None = None
    sources: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, cfg: Any) -> HardwareProfile:
        """Build and validate a profile from a mapping or an OmegaConf ``DictConfig``.

        Every problem is a one-line :class:`KVBenchError` naming the field and its valid values.
        """
        data = _to_plain_dict(cfg)
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise KVBenchError(f"hardware profile: unknown key(s) {', '.join(unknown)}; "
                               f"valid keys: {', '.join(valid)}")
        missing = [k for k in ("name", "device", "dtype", "memory_bytes") if data.get(k) is None]
        if missing:
            raise KVBenchError(f"hardware profile: missing required key(s) {', '.join(missing)}")
        name = data["name"]
        if not isinstance(name, str) or not name.strip():
            raise KVBenchError(f"hardware profile: name must be a non-empty string, got {name!r}")
        where = f"hardware={name}"
        device = data["device"]
        if device not in DEVICES:
            raise KVBenchError(f"{where}: unknown device {device!r}; valid: {', '.join(DEVICES)}")
        dtype = data["dtype"]
        if dtype not in DTYPES:
            raise KVBenchError(f"{where}: unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
        memory_bytes = data["memory_bytes"]
        if not _is_int(memory_bytes) or memory_bytes <= 0:
            raise KVBenchError(f"{where}: memory_bytes must be a positive integer (bytes), "
                               f"got {memory_bytes!r}")
        threads = data.get("threads")
        if threads is not None and (not _is_int(threads) or threads < 1):
            raise KVBenchError(f"{where}: threads must be null (torch default) or an integer >= 1, "
                               f"got {threads!r}")
        simulate = data.get("simulate", False)
        if not isinstance(simulate, bool):
            raise KVBenchError(f"{where}: simulate must be true or false, got {simulate!r}")
        figures: dict[str, float | None] = {}
        for key in ("device_mem_bw_gbps", "host_link_bw_gbps", "disk_bw_gbps", "peak_flops"):
            value = data.get(key)
            if value is not None and (not _is_number(value) or not math.isfinite(value) or value <= 0):
                raise KVBenchError(f"{where}: {key} must be null or a positive number, got {value!r}")
            figures[key] = None if value is None else float(value)
        sources = data.get("sources") or []
        if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
            raise KVBenchError(f"{where}: sources must be a list of strings")
        return cls(name=name, device=device, dtype=dtype, memory_bytes=int(memory_bytes),
                   threads=None if threads is None else int(threads), simulate=simulate,
                   sources=list(sources), **figures)

    def to_dict(self) -> dict[str, Any]:
        """The profile as plain YAML-ready data (same keys as the config files)."""
        return asdict(self)


def _to_plain_dict(cfg: Any) -> dict[str, Any]:
    # Hydra hands us a DictConfig; tests and the calculator hand plain dicts.
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # omegaconf is a dependency; this only guards stripped-down installs
        pass
    if not isinstance(cfg, Mapping):
        raise KVBenchError(f"hardware profile must be a mapping of keys to values, got {type(cfg).__name__}")
    return dict(cfg)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def load_profile(name_or_path: str | os.PathLike[str]) -> HardwareProfile:
    """Load a shipped profile by name (``consumer-gpu-24g``) or any profile YAML by path."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or candidate.is_file():
        path = candidate
    else:
        path = hardware_dir() / f"{name_or_path}.yaml"
    if not path.is_file():
        raise KVBenchError(f"unknown hardware {str(name_or_path)!r}; "
                           f"valid: {', '.join(available_profiles())} (or a path to a profile YAML)")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise KVBenchError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from exc
    return HardwareProfile.from_config(data)


def check_available(profile: HardwareProfile) -> str:
    """Return the torch device to run on for ``profile``.

    A ``cuda`` profile on a machine without a visible CUDA device is an error unless the profile
    has ``simulate: true``; then the run happens on ``cpu`` and the caller must label every figure
    derived from the profile as modelled, not measured.
    """
    if profile.device == "cpu":
        return "cpu"
    import torch  # torch is imported lazily so that `kvbench calc` starts without it

    if torch.cuda.is_available():
        return "cuda"
    if profile.simulate:
        return "cpu"
    raise KVBenchError(f"hardware={profile.name} needs a CUDA device; none is visible. "
                       "Run on a CUDA machine or pass hardware.simulate=true "
                       "to run here with modelled figures labelled as such")


def _figure(profile: HardwareProfile, key: str) -> float:
    value = getattr(profile, key)
    if value is None:
        raise KVBenchError(f"hardware={profile.name} has no {key} figure; fill it in the profile "
                           "or measure this machine with `kvbench hardware probe`")
    return float(value)


def modelled_transfer_seconds(profile: HardwareProfile, nbytes: float, link: str) -> float:
    """Seconds to move ``nbytes`` over ``link`` (``device``, ``host`` or ``disk``) at the profile's figure.

    ``nbytes`` is traffic on that link: a copy *within* device memory reads and writes each byte,
    so pass twice its size for ``device``. On a CPU-only profile there is no host link — the
    "host" tier is the same memory — so a ``host`` transfer is modelled as an in-memory copy.
    Datasheet figures are peaks, so the result is a lower bound on the real time.
    """
    if link not in LINKS:
        raise KVBenchError(f"unknown link {link!r}; valid: {', '.join(LINKS)}")
    if not _is_number(nbytes) or nbytes < 0:
        raise KVBenchError(f"nbytes must be a non-negative number, got {nbytes!r}")
    if link == "host" and profile.device == "cpu" and profile.host_link_bw_gbps is None:
        return 2.0 * nbytes / (_figure(profile, "device_mem_bw_gbps") * GB)
    return nbytes / (_figure(profile, LINKS[link]) * GB)


def modelled_recompute_seconds(profile: HardwareProfile, flops: float) -> float:
    """Seconds to execute ``flops`` floating-point operations at the profile's peak (a lower bound)."""
    if not _is_number(flops) or flops < 0:
        raise KVBenchError(f"flops must be a non-negative number, got {flops!r}")
    return flops / _figure(profile, "peak_flops")


# -- roofline: the one model of a decode step's and a prefill's time, shared by `kvbench advise` and
# scripts/bench_throughput.py --------------------------------------------------------------------------------
MEMORY, COMPUTE = "memory", "compute"


def attention_flops(head_dim: int, held_tokens: float, heads: int) -> float:
    """FLOPs of one new token's attention over ``held_tokens`` (tokens held, summed over layers): every query head
    scores each held token (q·k, 2 × head_dim) and mixes its value (p·v, 2 × head_dim). Grouped-query attention
    (Ainslie et al., 2023, "GQA") shares each KV head among ``heads / kv_heads`` query heads: it divides the bytes
    read, not these FLOPs, so the KV head count does not appear here."""
    return 4 * head_dim * held_tokens * heads


def roofline_seconds(nbytes: float, flops: float, bandwidth_bytes_per_s: float, flops_per_s: float
                     ) -> tuple[float, str]:
    """(seconds, bound) of a step that moves ``nbytes`` and computes ``flops``: the larger of bytes over the
    bandwidth and FLOPs over the FLOP/s, and which of the two it is. Peak figures make it a lower bound."""
    mem, comp = nbytes / bandwidth_bytes_per_s, flops / flops_per_s
    return (mem, MEMORY) if mem >= comp else (comp, COMPUTE)


def profile_roofline(profile: HardwareProfile, nbytes: float, flops: float) -> tuple[float, str]:
    """:func:`roofline_seconds` over ``profile``'s device-memory bandwidth and peak FLOP/s."""
    return roofline_seconds(nbytes, flops, _figure(profile, "device_mem_bw_gbps") * GB,
                            _figure(profile, "peak_flops"))
