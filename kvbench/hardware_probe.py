"""``kvbench hardware probe|list``: measure the machine at hand into a hardware profile, and list the shipped ones.

The probe times what the profile's figures stand for (:mod:`kvbench.hardware` defines the profile and the cost
models that read it): a tensor ``copy_`` for memory bandwidth (counted as read + write traffic, as datasheets
and STREAM count it), pinned host<->device copies for the link, ``write`` + ``fsync`` and a cold ``memmap``
read for the disk — the file evicted from the page cache with ``posix_fadvise(DONTNEED)`` and the eviction
checked with ``mincore`` (through ``ctypes``) — and ``torch.matmul`` for FLOP/s. Each figure is the median of
repeated runs after a quarter of a second of untimed warm-up (:data:`WARMUP_S`), and the YAML it writes comments
every figure with its method.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from kvbench.errors import KVBenchError
from kvbench.hardware import GB, HardwareProfile, available_profiles, hardware_dir, load_profile

#: Untimed calls before a figure is timed, for at least this long: one warm-up call left a decode product's rate
#: at 3 rows 0.62x what it settles at a quarter of a second later (2026-12-07, AMD EPYC: the core's clock and the
#: thread pool ramp up under load), so a rate measured cold swung a throughput roofline by a third between runs.
WARMUP_S = 0.25


def _timed_seconds(fn: Callable[[], None], repeats: int, sync: Callable[[], None] | None = None,
                   best: bool = False) -> float:
    """Wall time of ``fn``, the median of ``repeats`` calls (``best``: the fastest, what a bound such as a roofline
    wants: noise only ever slows a call), after untimed calls for :data:`WARMUP_S` (first calls pay allocation and
    JIT, and the clock ramps up)."""
    start = time.perf_counter()
    while True:
        fn()
        if sync:
            sync()
        if time.perf_counter() - start >= WARMUP_S:
            break
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - start)
    return min(times) if best else statistics.median(times)


def measure_copy_bandwidth(nbytes: int, repeats: int = 5, device: str = "cpu", best: bool = False) -> float:
    """Memory bandwidth in GB/s from ``dst.copy_(src)`` of an ``nbytes`` tensor on ``device`` (``best``: from the
    fastest copy, see :func:`_timed_seconds`).

    Counted as bus traffic (2 × nbytes per copy: one read, one write) so the figure is comparable
    with datasheet bandwidths.
    """
    import torch

    numel = max(1, nbytes // 4)
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    seconds = _timed_seconds(lambda: dst.copy_(src), repeats, sync, best)
    return 2 * numel * 4 / seconds / GB


def measure_matmul_flops(n: int, dtype: str, repeats: int = 5, device: str = "cpu", best: bool = False) -> float:
    """Dense matmul throughput in FLOP/s: median (``best``: shortest) time of ``torch.matmul`` on two n×n matrices
    (2n³ FLOPs)."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=getattr(torch, dtype))
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=getattr(torch, dtype))
    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    seconds = _timed_seconds(lambda: torch.matmul(a, b), repeats, sync, best)
    return 2.0 * n**3 / seconds


def measure_linear_flops(rows: int, in_features: int, out_features: int, dtype: str, repeats: int = 20,
                         device: str = "cpu", path: str = "native", best: bool = False) -> float:
    """FLOP/s of one linear layer at its shape: ``rows`` inputs of ``in_features`` times an ``[out_features,
    in_features]`` weight of ``dtype`` (2 · rows · in · out FLOPs), median (``best``: shortest) of ``repeats``, as
    ``engine.linear=path`` computes it (:mod:`kvbench.linear`: ``native``, in ``dtype``; ``upcast``, a 16-bit
    weight upcast to float32 at each call, the conversion timed with the product). A decode step's products have
    one row per sequence, and their attainable rate is not the square matmul's (a skinny product is dispatched to
    other kernels; without native bf16 instructions a bf16 one runs far below float32's)."""
    import torch

    from kvbench import linear

    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, in_features, generator=gen).to(device=device, dtype=getattr(torch, dtype))
    layer = torch.nn.Linear(in_features, out_features, bias=False).to(device=device, dtype=getattr(torch, dtype))
    if path != "native":
        linear.use(torch.nn.Sequential(layer), path, device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    with torch.inference_mode():
        seconds = _timed_seconds(lambda: layer(x), repeats, sync, best)
    return 2.0 * rows * in_features * out_features / seconds


def measure_host_link(nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Pinned host<->CUDA copy bandwidth in GB/s, each direction (one-way traffic, N bytes per copy)."""
    import torch

    numel = max(1, nbytes // 4)
    host = torch.ones(numel, dtype=torch.float32).pin_memory()
    dev = torch.empty(numel, dtype=torch.float32, device="cuda")
    sync = torch.cuda.synchronize
    h2d = _timed_seconds(lambda: dev.copy_(host, non_blocking=True), repeats, sync)
    d2h = _timed_seconds(lambda: host.copy_(dev, non_blocking=True), repeats, sync)
    return {"h2d_gbps": numel * 4 / h2d / GB, "d2h_gbps": numel * 4 / d2h / GB}


def _resident_fraction(path: Path) -> float | None:
    """Fraction of ``path``'s pages in the page cache (Linux ``mincore``); None where unavailable."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mapped = np.memmap(path, dtype=np.uint8, mode="r")
        pages = (mapped.size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        rc = libc.mincore(ctypes.c_void_p(mapped.ctypes.data), ctypes.c_size_t(mapped.size), vec)
        del mapped
    except (OSError, AttributeError):
        return None
    if rc != 0:
        return None
    return sum(v & 1 for v in vec) / pages


def _drop_from_page_cache(path: Path) -> None:
    # posix_fadvise(DONTNEED) evicts a file's clean pages without root (unlike drop_caches).
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure_disk_bandwidth(nbytes: int, repeats: int = 3, directory: str | os.PathLike[str] | None = None
                           ) -> dict[str, float | None]:
    """Disk bandwidth through a temporary file of ``nbytes`` random bytes in ``directory``.

    Three figures, GB/s, median of ``repeats``:

    * ``write_gbps`` — ``write`` + ``fsync``: the data reached the device;
    * ``cold_read_gbps`` — read back through a numpy memmap after ``posix_fadvise(DONTNEED)``
      evicted the file from the page cache; ``cold_resident_fraction`` reports how much of the file
      was still cached when the read began (``mincore``), so a drop that did not take is visible;
      ``None`` where the platform offers neither call;
    * ``cached_read_gbps`` — the same read repeated with nothing dropped: page-cache speed, not disk.

    Random bytes keep compressing or deduplicating storage from flattering the figures.
    """
    data = np.random.default_rng(0).integers(0, 256, size=max(1, nbytes), dtype=np.uint8)
    out = np.empty_like(data)
    writes, cold, cached, resident = [], [], [], []
    fd, name = tempfile.mkstemp(prefix="kvbench-probe-", dir=directory)
    path = Path(name)
    os.close(fd)
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            with open(path, "wb") as fh:
                fh.write(memoryview(data))
                fh.flush()
                os.fsync(fh.fileno())
            writes.append(time.perf_counter() - start)
            if hasattr(os, "posix_fadvise"):
                _drop_from_page_cache(path)
                fraction = _resident_fraction(path)
                if fraction is not None:
                    resident.append(fraction)
                cold.append(_timed_memmap_read(path, out))
            cached.append(_timed_memmap_read(path, out))
    finally:
        path.unlink(missing_ok=True)
    return {
        "write_gbps": data.size / statistics.median(writes) / GB,
        "cold_read_gbps": data.size / statistics.median(cold) / GB if cold else None,
        "cold_resident_fraction": max(resident) if resident else None,
        "cached_read_gbps": data.size / statistics.median(cached) / GB,
    }


def _timed_memmap_read(path: Path, out: np.ndarray) -> float:
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    start = time.perf_counter()
    np.copyto(out, mapped)
    seconds = time.perf_counter() - start
    del mapped
    return seconds


def _host_memory_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def probe(out_path: str | os.PathLike[str], *, name: str | None = None, dtype: str = "auto",
          copy_bytes: int = 512 << 20, disk_bytes: int = 256 << 20, matmul_n: int | None = None,
          repeats: int = 5, disk_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Measure this machine and write a profile YAML to ``out_path``.

    Measured (see :func:`measure_copy_bandwidth`, :func:`measure_disk_bandwidth`,
    :func:`measure_matmul_flops`, :func:`measure_host_link`): host memory copy bandwidth, disk
    write/read bandwidth, bf16 and fp32 matmul FLOP/s, and — when CUDA is visible — device memory
    bandwidth, pinned host<->device bandwidth and device matmul FLOP/s. With CUDA the profile
    describes the GPU (``device: cuda``); otherwise the host.

    ``dtype="auto"`` picks whichever of bfloat16/float32 multiplied faster; ``peak_flops`` is that
    dtype's figure. ``disk_bw_gbps`` is the slower of write+fsync and cold read, because a spill
    tier pays both. ``host_link_bw_gbps`` is the slower direction. Returns
    ``{"profile": <the YAML's fields>, "measurements": <every figure>, "path": <str>}``.
    """
    if dtype not in ("auto", "bfloat16", "float32"):
        raise KVBenchError(f"probe dtype {dtype!r} is not valid; valid: auto, bfloat16, float32")
    if repeats < 1:
        raise KVBenchError(f"repeats must be >= 1, got {repeats}")
    import torch

    out = Path(out_path)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    n = matmul_n or (8192 if cuda else 2048)  # a GPU needs larger matrices to reach its peak
    measured: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "matmul_n": n,
                                "copy_bytes": copy_bytes, "disk_bytes": disk_bytes, "repeats": repeats}
    measured["host_copy_gbps"] = measure_copy_bandwidth(copy_bytes, repeats, "cpu")
    measured.update({f"disk_{k}": v for k, v in
                     measure_disk_bandwidth(disk_bytes, max(1, min(repeats, 3)), disk_dir).items()})
    measured["bfloat16_flops"] = measure_matmul_flops(n, "bfloat16", repeats, device)
    measured["float32_flops"] = measure_matmul_flops(n, "float32", repeats, device)
    host_link = None
    if cuda:
        measured["device_name"] = torch.cuda.get_device_name(0)
        measured["device_copy_gbps"] = measure_copy_bandwidth(copy_bytes, repeats, "cuda")
        measured.update(measure_host_link(copy_bytes, repeats))
        host_link = min(measured["h2d_gbps"], measured["d2h_gbps"])
        memory_bytes = int(torch.cuda.get_device_properties(0).total_memory)
        device_bw = measured["device_copy_gbps"]
    else:
        memory_bytes = _host_memory_bytes()
        device_bw = measured["host_copy_gbps"]
    if dtype == "auto":
        dtype = "bfloat16" if measured["bfloat16_flops"] >= measured["float32_flops"] else "float32"
    disk_figures = [measured["disk_write_gbps"]]
    if measured["disk_cold_read_gbps"] is not None:
        disk_figures.append(measured["disk_cold_read_gbps"])
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%MZ")
    profile = HardwareProfile(
        name=name or out.stem, device=device, dtype=dtype, threads=None, simulate=False,
        memory_bytes=memory_bytes, device_mem_bw_gbps=round(device_bw, 2),
        host_link_bw_gbps=None if host_link is None else round(host_link, 2),
        disk_bw_gbps=round(min(disk_figures), 3), peak_flops=float(f"{measured[f'{dtype}_flops']:.4g}"),
        sources=[f"measured by kvbench hardware probe on {socket.gethostname()} at {stamp}"],
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_profile_yaml(profile, measured))
    return {"profile": profile.to_dict(), "measurements": measured, "path": str(out)}


def _scalar(value: Any) -> str:
    """One YAML scalar. Floats always carry a dot (and a signed exponent when large or tiny): PyYAML
    reads ``1e14`` as a string while OmegaConf reads it as a float, and ``1.0e+14`` is a float to both."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e6:
            text = repr(value)
            return text if "." in text else text + ".0"
        mantissa, exponent = f"{value:.3e}".split("e")
        mantissa = mantissa.rstrip("0")
        return f"{mantissa}0e{exponent}" if mantissa.endswith(".") else f"{mantissa}e{exponent}"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid YAML double-quoted scalar
    return str(value)


def _plain_or_scalar(value: Any) -> str:
    """A string unquoted when YAML reads it back unchanged (``name: cpu``), else :func:`_scalar`."""
    if isinstance(value, str) and value and yaml.safe_load(value) == value and ":" not in value:
        return value
    return _scalar(value)


def render_profile_yaml(profile: HardwareProfile, measured: Mapping[str, Any]) -> str:
    """The probe's YAML: the schema of ``conf/hardware/cpu.yaml``, each figure commented with its method."""

    def gbps(key: str) -> str:
        value = measured.get(key)
        return "n/a" if value is None else f"{value:.2f} GB/s"

    other = "float32" if profile.dtype == "bfloat16" else "bfloat16"
    cold = measured.get("disk_cold_resident_fraction")
    cold_note = "" if cold is None else f", {cold:.0%} cached at read start"
    size = f"{measured['copy_bytes'] >> 20} MiB, median of {measured['repeats']}"
    if profile.device == "cuda":
        device_name = measured.get("device_name", "unknown GPU")
        header = f"# A CUDA host ({device_name}). Figures measured by `kvbench hardware probe`."
        mem_note = "device memory reported by torch.cuda"
        bw_note = f"device tensor copy_ as read+write traffic, {size}; host RAM {gbps('host_copy_gbps')}"
        link_note = f"pinned copies, slower direction: h2d {gbps('h2d_gbps')}, d2h {gbps('d2h_gbps')}"
    else:
        header = "# This machine class: a CPU-only host. Bandwidths measured with `kvbench hardware probe`."
        mem_note = f"{profile.memory_bytes / 2**30:.1f} GiB host RAM (psutil)"
        bw_note = f"host tensor copy_ as read+write traffic, {size}"
        link_note = "no host<->device link on a CPU-only host"
    rows = [
        ("name", profile.name, None),
        ("device", profile.device, None),
        ("dtype", profile.dtype, "the faster matmul here of bfloat16/float32 (measured) unless --dtype"),
        ("threads", profile.threads, "null: torch default (all cores)"),
        ("simulate", profile.simulate,
         'true: run on what is here, label every profile-derived figure "modelled"'),
        ("memory_bytes", profile.memory_bytes, mem_note),
        ("device_mem_bw_gbps", profile.device_mem_bw_gbps, bw_note),
        ("host_link_bw_gbps", profile.host_link_bw_gbps, link_note),
        ("disk_bw_gbps", profile.disk_bw_gbps,
         f"min(write+fsync {gbps('disk_write_gbps')}, cold read {gbps('disk_cold_read_gbps')}{cold_note}); "
         f"page-cache read {gbps('disk_cached_read_gbps')}"),
        ("peak_flops", profile.peak_flops,
         f"{profile.dtype} matmul {measured['matmul_n']}x{measured['matmul_n']}, "
         f"{measured['torch_threads']} threads; "
         f"{other} {measured[f'{other}_flops']:.3g} FLOP/s"),
    ]
    lines = [header]
    for key, value, comment in rows:
        text = f"{key}: {_plain_or_scalar(value)}"
        lines.append(text if comment is None else f"{text:<34} # {comment}")
    lines.append("sources:")
    lines.extend(f"  - {_scalar(s)}" for s in profile.sources)
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- CLI


def _print_profiles() -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"hardware profiles in {hardware_dir()}")
    columns = ("name", "device", "dtype", "memory", "device GB/s", "host link GB/s", "disk GB/s",
               "peak FLOP/s")
    for col in columns:
        table.add_column(col, justify="left" if col in ("name", "device", "dtype") else "right")
    for stem in available_profiles():
        p = load_profile(stem)
        table.add_row(p.name, p.device, p.dtype, f"{p.memory_bytes / 2**30:.0f} GiB",
                      *("-" if v is None else f"{v:g}" for v in (p.device_mem_bw_gbps, p.host_link_bw_gbps,
                                                                  p.disk_bw_gbps)),
                      "-" if p.peak_flops is None else f"{p.peak_flops:.3g}")
    Console(file=sys.stdout, width=None if sys.stdout.isatty() else 120).print(table)


def build_parser() -> argparse.ArgumentParser:
    """Parser for ``kvbench hardware``."""
    parser = argparse.ArgumentParser(prog="kvbench hardware",
                                     description="Hardware profiles and the machine probe.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("probe", help="measure this machine and write a profile YAML")
    p.add_argument("--out", default=None,
                   help="where to write the profile "
                        "(default: <conf>/hardware/probed.yaml, usable as hardware=probed)")
    p.add_argument("--name", default=None, help="profile name (default: the output file's stem)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="profile dtype; auto = whichever matmul measured faster")
    p.add_argument("--copy-mib", type=int, default=512, help="tensor size for the memory copy (MiB)")
    p.add_argument("--disk-mib", type=int, default=256, help="temporary file size for the disk test (MiB)")
    p.add_argument("--disk-dir", default=None,
                   help="directory for the disk test (default: the system temp dir); "
                        "point it at the drive that will hold a spill tier")
    p.add_argument("--matmul-n", type=int, default=None,
                   help="matrix side (default 2048 on CPU, 8192 on CUDA)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per figure (median reported)")
    sub.add_parser("list", help="print the shipped profiles")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvbench hardware``; returns the exit status (0 ok, 2 bad input)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help (0) and on bad arguments (2)
        return int(exc.code or 0)
    try:
        if args.command == "list":
            _print_profiles()
            return 0
        if min(args.copy_mib, args.disk_mib) < 1 or (args.matmul_n is not None and args.matmul_n < 1):
            raise KVBenchError("--copy-mib, --disk-mib and --matmul-n must be >= 1")
        out = Path(args.out) if args.out else hardware_dir() / "probed.yaml"
        result = probe(out, name=args.name, dtype=args.dtype, copy_bytes=args.copy_mib << 20,
                       disk_bytes=args.disk_mib << 20, matmul_n=args.matmul_n, repeats=args.repeats,
                       disk_dir=args.disk_dir)
    except KVBenchError as exc:
        print(f"kvbench hardware: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvbench hardware: error: {exc}", file=sys.stderr)
        return 2
    print(Path(result["path"]).read_text(), end="")
    print(f"# wrote {result['path']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
