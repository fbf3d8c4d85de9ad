"""``tiered``: a hot device tier plus cold host-memory and disk tiers read back on demand.

Offloading as in FlexGen (Sheng et al., ICML 2023, "FlexGen: High-Throughput Generative Inference of
Large Language Models with a Single GPU") and InfiniGen (Lee et al., OSDI 2024): the device keeps a
*hot* set — the first ``sink_tokens`` (attention sinks, Xiao et al. 2023 "StreamingLLM"), the
``recent_tokens`` newest tokens and optionally the ``hot_heavy_tokens`` most-attended tokens of each
KV head, scored from the captured observation-window queries as in SnapKV (Li et al. 2024) — and
every other token lives in a cold tier: ``host_fraction`` of them in host memory (pinned on CUDA),
the oldest rest on disk in memory-mapped files under ``kvbench.models.cache_dir()/"tiers"``,
optionally stored as int8 (``cold_quant``). Nothing is dropped: each step reads the cold blocks back
into a compute buffer and attends over every token in its original order, so with
``cold_quant=none`` the output equals ``full`` bit for bit.

As decoding proceeds the recent window slides: once ``block_tokens`` tokens have aged out of it,
they are demoted as one block to host or disk (keeping the host share at ``host_fraction``).

Prefetch: when layer *i* runs, the cold blocks of layer *i + 1* are read on a background thread, so
their copies overlap layer *i*'s attention and MLP; layer *i + 1* waits only for what is not done
(``measured_stall_seconds_per_step``). On CPU the "device" is host memory: the reads are real
memcpys (host tier) and real memory-mapped file reads (disk tier; with ``drop_page_cache`` the files
are evicted from the OS page cache after every write and read, so each read really comes from the
disk), and their wall time is *measured*; what a GPU would pay for the same bytes over PCIe/NVMe is
*modelled* from the hardware profile and labelled ``modelled_``. See ``docs/tiered-cache.md``.

Working copy (harness scratch, as for the quantized stores; ``engine.working_copy``, on by default): the
assembled K/V are kept between steps (``scratch_tensors()``), so each cold block is read, and timed, once —
the prefilled ones at the first step, a demoted one at the step after — instead of identically at every step.
The output is the same bit for bit; ``measured_read_seconds_per_step`` is then the sum of each current block's
timed read (what a step reading every block costs), and ``working_copy=False`` reads every block every step.

``kv_bytes`` counts device-resident bytes only (hot tier plus the position indices of cold blocks):
the mission is device memory. Host and disk bytes are reported in ``stats()``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from kvbench.strategies._quantstore import WorkingCopy, working_copy_enabled
from kvbench.strategies._tiers import (
    DiskPacket,
    HostPacket,
    Packet,
    StoreDir,
    join_group,
    modelled_transfer,
    prefetcher,
    run_profile,
    timed_read,
)
from kvbench.strategies.base import LayerCapture, LayerStore, Strategy, held_bytes, require

from kvbench import blockattn
from kvbench.errors import KVBenchError
from kvbench.quantizers import SymmetricInt8, gather_tokens, quantize_int8

_SERIAL = itertools.count()
Read = tuple[list[torch.Tensor], float]  # a block's tensors in compute memory, and the seconds the read took
_STREAMS: dict[torch.device, Any] = {}  # one side stream per CUDA device for prefetch copies


@dataclass
class ColdBlock:
    """Up to ``block_tokens`` cold tokens of one layer, in one tier."""

    packet: Packet
    tokens: int
    start: int | None  # first position when the block is one run of positions shared by all heads
    index: torch.Tensor | None  # else int32 positions [batch, kv_heads, tokens], on the compute device
    serial: int
    read_seconds: float | None = None  # wall seconds of its last measured read (None: not read yet)


def attention_mass(keys: torch.Tensor, capture: LayerCapture, window: int) -> torch.Tensor:
    """Softmax attention each key receives from the last ``window`` captured queries, summed over those
    queries and the query heads of its group: ``[batch, kv_heads, tokens]`` (SnapKV's observation vote)."""
    assert capture.queries is not None
    queries = capture.queries[..., -window:, :]
    b, hq, w, d = queries.shape
    hkv, t = keys.shape[1], keys.shape[-2]
    # Query head j reads KV head j // groups (transformers' repeat_kv layout).
    q = queries.float().reshape(b, hkv, (hq // hkv) * w, d)
    logits = q @ keys.float().transpose(-1, -2) * capture.scaling
    if capture.positions is not None:
        pos = capture.positions.reshape(-1, capture.positions.shape[-1])[0, -w:].to(keys.device)
    else:
        pos = torch.arange(t - w, t, device=keys.device)
    future = torch.arange(t, device=keys.device)[None, :] > pos[:, None]  # causal mask [w, t]
    logits.masked_fill_(future.repeat(hq // hkv, 1), float("-inf"))
    if capture.sinks is not None:  # GPT-OSS: each query head's sink logit takes its share, then is dropped
        sink = capture.sinks.float().to(keys.device).view(1, hkv, hq // hkv, 1).expand(b, hkv, hq // hkv, w)
        logits = torch.cat([logits, sink.reshape(b, hkv, -1, 1)], dim=-1)
        return torch.softmax(logits, dim=-1)[..., :t].sum(dim=-2)
    return torch.softmax(logits, dim=-1).sum(dim=-2)


class TieredStore(LayerStore):
    """Hot segments on the compute device; cold blocks in host memory or memory-mapped files."""

    def __init__(self, strategy: Tiered, layer_idx: int, num_layers: int) -> None:
        super().__init__(strategy, layer_idx, num_layers)
        self.cfg = strategy
        self.group = join_group(strategy, self)
        self.dir = StoreDir(prefix=f"L{layer_idx:03d}-")
        self.blocks: list[ColdBlock] = []
        self.sink: tuple[torch.Tensor, torch.Tensor] | None = None  # positions 0 .. s-1
        self.heavy: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # k, v, int32 positions
        self.recent: tuple[torch.Tensor, torch.Tensor] | None = None  # positions recent_start .. total-1
        self.recent_start = 0
        self.total = 0
        self.shape: tuple[int, int, int] | None = None  # batch, kv_heads, head_dim
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        self._staged: Future | None = None
        # Working copy (harness scratch, ``engine.working_copy``): every held token in position order, kept
        # between steps, so each cold block is read (and timed) once instead of at every step.
        self.work: tuple[WorkingCopy, WorkingCopy] | None = None
        # Measured counters (real wall time of the copies this process did).
        self.steps = 0
        self.read_bytes = {"host": 0, "disk": 0}
        self.read_seconds = 0.0
        self.stall_seconds = 0.0
        self.written_bytes = {"host": 0, "disk": 0}
        self.write_seconds = 0.0

    # -- building ------------------------------------------------------------------------------
    def _init(self, keys: torch.Tensor) -> None:
        b, h, _, d = keys.shape
        self.shape, self.dtype, self.device = (b, h, d), keys.dtype, keys.device
        if self.cfg.cold_quant == "int8":
            require(d % self.cfg.quant_group_size == 0,
                    f"tiered.quant_group_size={self.cfg.quant_group_size} must divide head_dim={d}; "
                    "valid: a divisor of head_dim among 8, 16, 32, 64, 128, 256")

    def prefill(self, keys: torch.Tensor, values: torch.Tensor, capture: LayerCapture | None) -> None:
        self._init(keys)
        cfg, t = self.cfg, keys.shape[-2]
        s = min(cfg.sink_tokens, t)
        r = min(cfg.recent_tokens, t - s)
        middle = t - s - r
        n_heavy = min(cfg.hot_heavy_tokens, middle)
        n_cold = middle - n_heavy
        # Slices are cloned: a view would keep the shared prefill's whole storage alive (and counted).
        self.sink = (keys[:, :, :s].clone(), values[:, :, :s].clone())
        self.recent = (keys[:, :, t - r:].clone(), values[:, :, t - r:].clone())
        self.recent_start, self.total = t - r, t
        cold_index: torch.Tensor | None = None
        if n_heavy:
            if capture is None or capture.queries is None:
                raise KVBenchError("tiered.hot_heavy_tokens > 0 needs the captured queries: build the cache "
                                   "with KVBenchCache.from_capture(..., captures) or inside cache.attach(model)")
            mass = attention_mass(keys, capture, cfg.observation_window)[..., s:s + middle]
            top = mass.topk(n_heavy, dim=-1).indices
            is_hot = torch.zeros_like(mass, dtype=torch.int8).scatter_(-1, top, 1)
            # A stable sort of the 0/1 flags lists cold positions first, then hot ones, each ascending.
            order = torch.argsort(is_hot, dim=-1, stable=True) + s
            cold_index, heavy_index = order[..., :n_cold], order[..., n_cold:]
            self.heavy = (gather_tokens(keys, heavy_index, -2), gather_tokens(values, heavy_index, -2),
                          heavy_index.to(torch.int32))
        n_host = round(cfg.host_fraction * n_cold)
        n_disk = n_cold - n_host
        # The oldest cold tokens go to disk, the newer ones (closer to the recent window) to host memory.
        for tier, lo, hi in (("disk", 0, n_disk), ("host", n_disk, n_cold)):
            for a in range(lo, hi, cfg.block_tokens):
                z = min(a + cfg.block_tokens, hi)
                if cold_index is None:
                    self._offload(keys[:, :, s + a:s + z], values[:, :, s + a:s + z], tier, s + a, None)
                else:
                    idx = cold_index[..., a:z]
                    self._offload(gather_tokens(keys, idx, -2), gather_tokens(values, idx, -2), tier, None, idx)

    def _offload(self, k: torch.Tensor, v: torch.Tensor, tier: str, start: int | None,
                 index: torch.Tensor | None) -> None:
        """Write one block to ``tier`` (the payload is copied; the caller's tensors are untouched)."""
        began = time.perf_counter()
        if self.cfg.cold_quant == "int8":
            qk, qv = quantize_int8(k, self.cfg.quant_group_size), quantize_int8(v, self.cfg.quant_group_size)
            payload = [qk.codes, qk.scales, qv.codes, qv.scales]
        else:
            payload = [k, v]
        assert self.device is not None
        packet: Packet = (HostPacket(payload, pin=self.device.type == "cuda") if tier == "host"
                          else DiskPacket(self.dir.get(), payload, self.cfg.drop_page_cache))
        self.write_seconds += time.perf_counter() - began
        self.written_bytes[tier] += packet.nbytes
        self.blocks.append(ColdBlock(packet, k.shape[-2], start,
                                     None if index is None else index.to(torch.int32), next(_SERIAL)))

    # -- one attention step ----------------------------------------------------------------------
    def _intake(self, keys: torch.Tensor, values: torch.Tensor) -> dict[int, Read]:
        """A step's new tokens join the recent window; returns the cold blocks a previous layer staged for it."""
        if self.recent is None:  # nothing prefilled: start an empty store
            self._init(keys)
            empty = keys[:, :, :0].clone(), values[:, :, :0].clone()
            self.sink, self.recent = empty, empty
        staged = self._take_staged()
        assert self.recent is not None
        self.recent = (torch.cat([self.recent[0], keys], dim=-2), torch.cat([self.recent[1], values], dim=-2))
        self.total += keys.shape[-2]
        return staged

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        staged = self._intake(keys, values)
        if self.cfg.prefetch:
            following = self.group.store(self.layer_idx + 1)
            if following is not None:
                following.stage()
        if self.work is not None:
            out = self._update_work(keys, values, staged)
        elif working_copy_enabled(self.strategy):
            out = self._assemble(staged)
            self.work = (WorkingCopy(), WorkingCopy())
            self.work[0].append(out[0])
            self.work[1].append(out[1])
            out = self.work[0].view(), self.work[1].view()
        else:
            out = self._assemble(staged)
        self._demote()
        self.steps += 1
        return out

    def attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
               scaling: float, softcap: float | None = None) -> torch.Tensor:
        """``LayerStore.attend``: the hot segments and each cold block in position order, a cold block read from its
        tier (timed) when the block reader reaches it and dropped once its values are weighted, so the step holds
        the hot tier plus at most one attention block of cold tokens, never the assembled cache. No prefetch:
        each read is on the step's path, as measured.

        Heavy hot tokens sit at scattered positions per KV head (the mask's columns are positions), and a working
        copy made by an earlier dense read is kept up to date by ``append``: both read densely."""
        if self.heavy is not None or self.work is not None:
            return super().attend(query, keys, values, mask, scaling, softcap)
        staged = self._intake(keys, values)  # none unless an earlier dense step staged this layer
        assert self.sink is not None and self.recent is not None
        cold = [_ColdRead(self, b, staged) for b in sorted(self.blocks, key=lambda b: b.start or 0)]
        kparts = [blockattn.Dense(self.sink[0]), *(c.keys for c in cold), blockattn.Dense(self.recent[0])]
        vparts = [blockattn.Dense(self.sink[1]), *(c.values for c in cold), blockattn.Dense(self.recent[1])]
        heads = keys.shape[1]
        out = blockattn.attend(query, blockattn.TokenRun(kparts, heads), blockattn.TokenRun(vparts, heads), mask,
                               scaling, softcap)
        self._demote()
        self.steps += 1
        return out

    def _read_block(self, block: ColdBlock, staged: dict[int, Read]) -> tuple[torch.Tensor, torch.Tensor]:
        """One cold block read back (from the staged prefetch, else now), timed and counted, decoded."""
        assert self.device is not None
        parts, seconds = staged.get(block.serial) or timed_read(block.packet, self.device)
        if self.device.type == "cuda":  # read on the prefetch stream, used on this one
            for p in parts:
                p.record_stream(torch.cuda.current_stream(self.device))
        block.read_seconds = seconds
        self.read_seconds += seconds
        self.read_bytes[block.packet.tier] += block.packet.nbytes
        return self._decode(parts)

    def _to_read(self) -> list[ColdBlock]:
        """The blocks a step reads: all of them, or with a working copy those not read into it yet."""
        return [b for b in self.blocks if self.work is None or b.read_seconds is None]

    def stage(self) -> None:
        """Start reading this layer's cold blocks on the prefetch thread (called by the previous layer)."""
        blocks = self._to_read()
        if self._staged is None and blocks and self.device is not None:
            self._staged = prefetcher().submit(_read_blocks, blocks, self.device)

    def _take_staged(self) -> dict[int, Read]:
        future, self._staged = self._staged, None
        if future is None:
            return {}
        began = time.perf_counter()
        result = future.result()
        self.stall_seconds += time.perf_counter() - began
        return result

    def _assemble(self, staged: dict[int, Read]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every held token in position order: hot segments placed directly, cold blocks read back."""
        assert self.shape is not None and self.sink is not None and self.recent is not None
        b, h, d = self.shape
        out_k = torch.empty(b, h, self.total, d, dtype=self.dtype, device=self.device)
        out_v = torch.empty_like(out_k)
        s = self.sink[0].shape[-2]
        out_k[:, :, :s], out_v[:, :, :s] = self.sink
        out_k[:, :, self.recent_start:], out_v[:, :, self.recent_start:] = self.recent
        if self.heavy is not None:
            hk, hv, pos = self.heavy
            _place(out_k, out_v, hk, hv, None, pos)
        self._read_into(out_k, out_v, self.blocks, staged)
        return out_k, out_v

    def _update_work(self, keys: torch.Tensor, values: torch.Tensor,
                     staged: dict[int, Read]) -> tuple[torch.Tensor, torch.Tensor]:
        """The working copy gains the step's tokens and the blocks demoted since the last step, read back from
        their tier (with ``cold_quant=int8`` attention reads their dequantized values from then on)."""
        assert self.work is not None
        wk, wv = self.work
        wk.append(keys)
        wv.append(values)
        self._read_into(wk.view(), wv.view(), self._to_read(), staged)
        return wk.view(), wv.view()

    def _read_into(self, out_k: torch.Tensor, out_v: torch.Tensor, blocks: list[ColdBlock],
                   staged: dict[int, Read]) -> None:
        """Read ``blocks`` (from the staged prefetch, else now), timed, and place them at their positions."""
        for block in blocks:
            k, v = self._read_block(block, staged)
            _place(out_k, out_v, k, v, block.start, block.index)

    def _decode(self, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.dtype is not None
        if self.cfg.cold_quant == "none":
            return parts[0], parts[1]
        g = self.cfg.quant_group_size
        return (SymmetricInt8(parts[0], parts[1], "token", g).dequantize(self.dtype),
                SymmetricInt8(parts[2], parts[3], "token", g).dequantize(self.dtype))

    def _demote(self) -> None:
        """Move whole blocks that aged out of the recent window to a cold tier."""
        assert self.recent is not None
        bt = self.cfg.block_tokens
        n_blocks = max(0, self.recent[0].shape[-2] - self.cfg.recent_tokens) // bt
        if not n_blocks:
            return
        k, v = self.recent
        for j in range(n_blocks):
            a = j * bt
            tier = self._tier_for(bt)
            self._offload(k[:, :, a:a + bt], v[:, :, a:a + bt], tier, self.recent_start + a, None)
        n = n_blocks * bt
        self.recent = (k[:, :, n:].clone(), v[:, :, n:].clone())
        self.recent_start += n

    def _tier_for(self, tokens: int) -> str:
        """Host while that keeps the host share of cold tokens within ``host_fraction``, else disk."""
        host = sum(b.tokens for b in self.blocks if b.packet.tier == "host")
        cold = sum(b.tokens for b in self.blocks)
        return "host" if host + tokens <= self.cfg.host_fraction * (cold + tokens) + 1e-9 else "disk"

    # -- accounting ------------------------------------------------------------------------------
    def tensors(self) -> Iterable[torch.Tensor]:
        """Device-resident tensors only: hot segments and cold-block positions (host/disk: see stats)."""
        held: list[torch.Tensor] = []
        for seg in (self.sink, self.heavy, self.recent):
            if seg is not None:
                held.extend(seg)
        held.extend(b.index for b in self.blocks if b.index is not None)
        return held

    def scratch_tensors(self) -> Iterable[torch.Tensor]:
        return [] if self.work is None else [t for w in self.work for t in w.tensors()]

    def num_tokens(self) -> int:
        return self.total

    def tier_tokens(self) -> dict[str, int]:
        host = sum(b.tokens for b in self.blocks if b.packet.tier == "host")
        disk = sum(b.tokens for b in self.blocks if b.packet.tier == "disk")
        return {"hot": self.total - host - disk, "host": host, "disk": disk}

    def tier_bytes(self) -> dict[str, int]:
        return {"hot": held_bytes(self.tensors()),
                "host": sum(b.packet.nbytes for b in self.blocks if b.packet.tier == "host"),
                "disk": sum(b.packet.nbytes for b in self.blocks if b.packet.tier == "disk")}

    def stats(self) -> dict[str, float]:
        """Whole-model figures: additive per-layer quantities are multiplied by the layer count, so the
        mean over layers that ``KVBenchCache.stats()`` takes is the sum over layers."""
        n = self.num_layers
        tb, tt = self.tier_bytes(), self.tier_tokens()
        total = max(self.total, 1)
        st: dict[str, float] = {
            "hot_bytes": n * tb["hot"], "host_bytes": n * tb["host"], "disk_bytes": n * tb["disk"],
            "total_held_bytes": n * sum(tb.values()),
            "hot_token_fraction": tt["hot"] / total, "host_token_fraction": tt["host"] / total,
            "disk_token_fraction": tt["disk"] / total,
            # Every step reads every cold block once: the bytes one step moves, at the current state.
            "step_host_read_bytes": n * tb["host"], "step_disk_read_bytes": n * tb["disk"],
            "step_read_bytes": n * (tb["host"] + tb["disk"]),
            "measured_steps": self.steps,
            "measured_offload_write_seconds": n * self.write_seconds,
        }
        if self.steps and self.work is not None:
            # Each block was read once, timed: a step that reads every cold block costs the sum of those reads.
            read = [b for b in self.blocks if b.read_seconds is not None]
            st["measured_read_bytes_per_step"] = n * sum(b.packet.nbytes for b in read)
            st["measured_read_seconds_per_step"] = n * sum(b.read_seconds or 0.0 for b in read)
            st["measured_stall_seconds_per_step"] = n * self.stall_seconds / self.steps
        elif self.steps:
            st["measured_read_bytes_per_step"] = n * sum(self.read_bytes.values()) / self.steps
            st["measured_read_seconds_per_step"] = n * self.read_seconds / self.steps
            st["measured_stall_seconds_per_step"] = n * self.stall_seconds / self.steps
        profile = run_profile(self.strategy)
        read = _modelled_reads(profile, tb["host"], tb["disk"])
        if read is not None:
            st["modelled_step_read_seconds"] = n * read
        write = _modelled_reads(profile, self.written_bytes["host"], self.written_bytes["disk"])
        if write is not None:
            st["modelled_offload_write_seconds"] = n * write
        return st

    def close(self) -> None:
        """Release every tier now: wait for a pending prefetch, drop host blocks, delete disk files."""
        if self._staged is not None:
            self._staged.result()
            self._staged = None
        for block in self.blocks:
            block.packet.close()
        self.blocks = []
        self.work = None
        self.dir.close()


class _ColdRead:
    """A cold block as two parts of ``blockattn.TokenRun`` s (its keys and its values): read from its tier when the
    keys are first scored, released when the values of its last token have been weighted."""

    def __init__(self, store: TieredStore, block: ColdBlock, staged: dict[int, Read]) -> None:
        self.store, self.block, self.staged = store, block, staged
        self.kv: list[torch.Tensor | None] | None = None
        self.keys, self.values = _ColdSide(self, 0), _ColdSide(self, 1)

    def get(self, which: int) -> torch.Tensor:
        if self.kv is None:
            self.kv = list(self.store._read_block(self.block, self.staged))
        x = self.kv[which]
        assert x is not None, "a cold block's keys are read once, before its values"
        return x

    def done(self, which: int) -> None:
        """The keys (0) after their last token is scored, the values (1) after their last token is weighted."""
        if self.kv is not None:
            self.kv[which] = None


class _ColdSide:
    def __init__(self, read: _ColdRead, which: int) -> None:
        self.read, self.which = read, which
        self.num_tokens = read.block.tokens

    def scores(self, q: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        out = blockattn.Dense(self.read.get(self.which)).scores(q, start, stop)
        if stop == self.num_tokens:
            self.read.done(self.which)
        return out

    def weighted(self, p: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        out = blockattn.Dense(self.read.get(self.which)).weighted(p, start, stop)
        if stop == self.num_tokens:
            self.read.done(self.which)
        return out


def _read_blocks(blocks: list[ColdBlock], device: torch.device) -> dict[int, Read]:
    """Prefetch-thread body: read each block, timing the real copies (on a side stream on CUDA)."""
    if device.type == "cuda":
        if device not in _STREAMS:
            _STREAMS[device] = torch.cuda.Stream(device)
        with torch.cuda.stream(_STREAMS[device]):
            return {b.serial: timed_read(b.packet, device) for b in blocks}
    return {b.serial: timed_read(b.packet, device) for b in blocks}


def _modelled_reads(profile: Any, host_bytes: int, disk_bytes: int) -> float | None:
    """Profile seconds to move host bytes over the host link and disk bytes from disk (then over the host
    link when the device is a GPU); ``None`` when the profile lacks a needed figure."""
    parts = []
    if host_bytes:
        parts.append(modelled_transfer(profile, host_bytes, "host"))
    if disk_bytes:
        parts.append(modelled_transfer(profile, disk_bytes, "disk"))
        if getattr(profile, "device", "cpu") == "cuda":
            parts.append(modelled_transfer(profile, disk_bytes, "host"))
    if any(p is None for p in parts):
        return None
    return float(sum(parts))  # type: ignore[arg-type]


def _place(out_k: torch.Tensor, out_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int | None,
           index: torch.Tensor | None) -> None:
    if start is not None:
        out_k[:, :, start:start + k.shape[-2]] = k
        out_v[:, :, start:start + v.shape[-2]] = v
        return
    assert index is not None
    idx = index.long().unsqueeze(-1).expand(-1, -1, -1, out_k.shape[-1])
    out_k.scatter_(2, idx, k)
    out_v.scatter_(2, idx, v)


@dataclass
class Tiered(Strategy):
    """Hot sink/recent/heavy tokens on the device; the rest in host memory and on disk, read each step."""

    name = "tiered"
    family = "tiered"
    same_kv_width = True  # hot and cold segments are reassembled into one K and one V buffer of one shape
    # Its stores hold files and cross-layer prefetch links: a deep copy would share them (kvbench.engine.can_clone).
    cache_copyable = False
    sink_tokens: int = 4
    recent_tokens: int = 64
    hot_heavy_tokens: int = 0
    observation_window: int = 32
    host_fraction: float = 0.5
    cold_quant: str = "none"
    quant_group_size: int = 64
    block_tokens: int = 128
    prefetch: bool = True
    drop_page_cache: bool = True

    @property
    def query_window(self) -> int | None:
        return self.observation_window if self.hot_heavy_tokens else 0  # queries only score heavy tokens

    def validate(self) -> None:
        for key in ("sink_tokens", "recent_tokens", "hot_heavy_tokens"):
            value = getattr(self, key)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                    f"tiered.{key} must be an integer >= 0 (got {value!r})")
        require(isinstance(self.observation_window, int) and self.observation_window >= 1,
                f"tiered.observation_window must be an integer >= 1 (got {self.observation_window!r})")
        require(isinstance(self.host_fraction, (int, float)) and 0.0 <= self.host_fraction <= 1.0,
                f"tiered.host_fraction must be a number in [0, 1] (got {self.host_fraction!r})")
        require(self.cold_quant in ("none", "int8"),
                f"tiered.cold_quant must be one of none, int8 (got {self.cold_quant!r})")
        require(self.quant_group_size in (8, 16, 32, 64, 128, 256),
                "tiered.quant_group_size must be one of 8, 16, 32, 64, 128, 256 "
                f"(got {self.quant_group_size!r})")
        require(isinstance(self.block_tokens, int) and self.block_tokens >= 1,
                f"tiered.block_tokens must be an integer >= 1 (got {self.block_tokens!r})")
        for key in ("prefetch", "drop_page_cache"):
            value = getattr(self, key)
            require(isinstance(value, bool), f"tiered.{key} must be true or false (got {value!r})")

    def new_layer(self, layer_idx: int, num_layers: int) -> LayerStore:
        return TieredStore(self, layer_idx, num_layers)
