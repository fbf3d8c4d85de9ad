"""Dequantized working copies (issue 14): quantized stores keep what can no longer change decoded, as harness
scratch. Attention must read bit-identical K/V with and without it, ``kv_bytes`` must not see it, and
``scratch_tensors()`` must report it."""

from __future__ import annotations

import pytest
import torch
from kvbench.strategies.base import LayerCapture, RunContext, held_bytes

from kvbench import strategies
from kvbench.quantizers import gather_tokens

# Every quantized strategy that keeps a working copy, with settings that exercise flushes, rolling windows,
# ragged channel groups and decode-time pruning within a short run (head_dim 16).
CASES = [
    ("int8", {}), ("int8", {"axis": "channel", "group_size": 8}),
    ("int4", {}), ("int4", {"group_size": 8, "residual_length": 16}),
    ("int4", {"group_size": 8, "residual_length": 16, "residual_layout": "window"}),
    ("int2", {"group_size": 8, "residual_length": 8}), ("int2", {"group_size": 8, "residual_length": 0}),
    ("fp8", {}), ("fp8", {"format": "e5m2", "scale": "channel"}),
    ("bfp", {}), ("bfp", {"mantissa_bits": 4, "block_size": 8}),
    ("channel_sparse", {}), ("channel_sparse", {"recent_window": 4, "prune_decoded": True}),
    ("channel_sparse", {"mode": "outlier"}),
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _case_id(case: tuple[str, dict]) -> str:
    name, params = case
    return name + "".join(f"-{k}={v}" for k, v in params.items())


def test_every_quantized_strategy_is_covered() -> None:
    """A new quantization-family strategy must be added to CASES (or shown to hold no working copy)."""
    covered = {name for name, _ in CASES}
    family = {n for n in strategies.available() if strategies.strategy_class(n).family == "quantization"}
    assert family <= covered


def _run(name: str, params: dict, working: bool, dtype: torch.dtype, select: bool, batch: int = 2):
    """Prefill 70 tokens, decode 30 steps (some of 3 tokens), optionally dropping a token every 4th step."""
    g = torch.Generator().manual_seed(0)
    strategy = strategies.build(name, params)
    strategy.bind(RunContext(working_copy=working))
    store = strategy.new_layer(0, 1)

    def kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.randn(batch, 2, n, 16, generator=g) * 3
        k[..., ::5] *= 6  # outlier channels
        return k.to(dtype), torch.randn(batch, 2, n, 16, generator=g).to(dtype)

    q = torch.randn(batch, 4, 8, 16, generator=g).to(dtype)
    store.prefill(*kv(70), LayerCapture(layer_idx=0, num_kv_groups=2, scaling=0.25, queries=q))
    outputs, held = [], []
    for step in range(30):
        k, v = store.append(*kv(3 if step % 7 == 3 else 1))
        outputs.append((k.clone(), v.clone()))  # views of the working copy change with later steps
        held.append(held_bytes(store.tensors()))
        if select and step % 4 == 1:
            n = store.num_tokens()
            keep = torch.tensor([i for i in range(n) if i != 2 + step % (n - 4)])
            store.select_tokens(keep.expand(batch, 2, -1))
    return store, outputs, held


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("select", [False, True], ids=["decode", "decode+evict"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_working_copy_is_bit_identical_and_not_counted(case: tuple[str, dict], select: bool,
                                                        dtype: torch.dtype) -> None:
    name, params = case
    with_copy, out_a, bytes_a = _run(name, params, True, dtype, select)
    without, out_b, bytes_b = _run(name, params, False, dtype, select)
    for step, ((ka, va), (kb, vb)) in enumerate(zip(out_a, out_b, strict=True)):
        assert torch.equal(ka, kb) and torch.equal(va, vb), step
    assert bytes_a == bytes_b  # kv_bytes is the format's bytes, whatever scratch is kept
    # The held codes, metadata and residuals themselves: a stream that encodes its residual window in batches
    # (token-wise formats, with a working copy only) holds what encoding token by token holds, bit for bit.
    held_a, held_b = list(with_copy.tensors()), list(without.tensors())
    assert [t.shape for t in held_a] == [t.shape for t in held_b]
    assert all(torch.equal(a, b) for a, b in zip(held_a, held_b, strict=True))
    scratch = list(with_copy.scratch_tensors())
    assert scratch and list(without.scratch_tensors()) == []
    # The scratch holds (at least) the decoded K/V of every held token, and is never part of tensors().
    held = {t.untyped_storage().data_ptr() for t in with_copy.tensors()}
    assert not held & {t.untyped_storage().data_ptr() for t in scratch}
    assert held_bytes(scratch) >= with_copy.num_tokens() * 2 * 2 * 16 * dtype.itemsize * (
        1 if name == "channel_sparse" and params.get("mode", "prune") == "prune" else 2)


@pytest.mark.parametrize("case", [("int4", {}), ("int8", {}), ("fp8", {})], ids=_case_id)
def test_decode_writes_rows_not_the_whole_prefix(case: tuple[str, dict]) -> None:
    """The working copy grows in place: over many steps its storage is reallocated only a few times."""
    name, params = case
    store = strategies.build(name, params).new_layer(0, 1)
    store.prefill(torch.randn(1, 2, 256, 16), torch.randn(1, 2, 256, 16), None)
    storages = set()
    for _ in range(300):
        k, _ = store.append(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
        storages.add(k.untyped_storage().data_ptr())
    assert len(storages) <= 4  # 256 -> 556 tokens with 25% headroom: a handful of growths, not 300 copies


@pytest.mark.parametrize("name", ["int4", "int8", "fp8"])
def test_working_copy_only_for_dense_reads_and_the_engine_flag_turns_it_off(name: str) -> None:
    """A working copy is made by the first dense read (``append``, what SDPA or eager attention gets), never by
    ``attend`` (which reads the codes block by block), and never with ``working_copy=False``."""
    def scratch(store: strategies.base.LayerStore) -> int:
        return sum(t.numel() * t.element_size() for t in store.scratch_tensors())

    for working, want in ((None, True), (True, True), (False, False)):
        strategy = strategies.build(name)
        if working is not None:
            strategy.bind(RunContext(working_copy=working))
        store = strategy.new_layer(0, 1)
        store.prefill(torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16), None)
        for _ in range(3):
            store.attend(torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), None, 0.25)
        held = held_bytes(store.tensors())
        # no dense copy: at most int4's encoded value window (KIVI's R = 128 tokens of codes)
        assert scratch(store) < held / 4
        store.append(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
        assert (scratch(store) > held / 2) is want


def test_select_tokens_keeps_the_decoded_values() -> None:
    """Dropping tokens gathers the working copy: kept tokens keep exactly the values attention read (with
    the window layout, which quantizes before attending: under KIVI's own a step reads its flushed tokens
    exact one last time)."""
    params = {"group_size": 8, "residual_length": 8, "residual_layout": "window"}
    store = strategies.build("int4", params).new_layer(0, 1)
    store.prefill(torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16), None)
    k, v = store.append(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    k, v = k.clone(), v.clone()
    index = torch.arange(0, 41, 2).expand(1, 2, -1)
    store.select_tokens(index)
    k2, v2 = store.append(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    assert torch.equal(k2[..., :-1, :], gather_tokens(k, index, -2))
    assert torch.equal(v2[..., :-1, :], gather_tokens(v, index, -2))


def test_chunk_list_counts_follow_its_pieces() -> None:
    """The token counts :class:`ChunkList` keeps beside its pieces (so a decode step does not ask every piece)
    stay equal to the pieces' own counts through binary-counter merges (of every piece but an open tail), a
    merge into one chunk and a reset, and the pieces decode to the tokens appended, in order."""
    from kvbench.strategies._quantstore import ChunkList

    from kvbench.quantizers import quantize_int8

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 120, 16, generator=gen)
    chunks, start = ChunkList(), 0
    for n in (1, 1, 3, 1, 2, 5, 1, 1, 1, 8, 2, 1, 9, 12, 1, 1, 30, 4, 8, 8, 8, 8, 1):
        chunks.append(quantize_int8(x[..., start:start + n, :], 16))
        start += n
        assert chunks.lengths == [p.num_tokens for p in chunks.pieces] and chunks.num_tokens == start
        done = chunks.lengths[:-1] if chunks.spare else chunks.lengths
        assert done == sorted(set(done), reverse=True), "merged like a binary counter"
    whole = torch.cat([p.dequantize(torch.float32) for p in chunks.pieces], dim=-2)
    assert torch.equal(whole, quantize_int8(x[..., :start, :], 16).dequantize(torch.float32))
    merged = chunks.merged()
    assert merged is not None and chunks.lengths == [start] == [merged.num_tokens]
    chunks.set(None)
    assert chunks.lengths == [] and chunks.num_tokens == 0 and chunks.merged() is None


def test_a_decode_steps_tokens_go_into_a_reserved_tail_that_is_counted_and_sealed_exactly() -> None:
    """Single tokens after the first piece are written into a tail of ``TAIL_TOKENS`` reserved slots: the pieces
    read the same codes as pieces of their own would, the reserve is held (counted), a filled tail is an ordinary
    piece holding exactly its tokens, and a larger piece, ``merged`` or ``seal`` leaves no spare slot."""
    from kvbench.strategies._quantstore import TAIL_APPEND, TAIL_TOKENS, ChunkList
    from kvbench.strategies.base import held_bytes

    from kvbench.quantizers import quantize_int8

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 3 * TAIL_TOKENS + 40, 16, generator=gen)
    per_token = 2 * 16 + 2 * 2  # int8 codes and one float16 scale per head and token
    chunks = ChunkList()
    chunks.append(quantize_int8(x[..., :20, :], 16))
    assert chunks.spare == 0 and held_bytes(chunks.tensors()) == 20 * per_token, "a first piece is never a tail"
    for t in range(20, 20 + TAIL_TOKENS + 5):
        chunks.append(quantize_int8(x[..., t:t + 1, :], 16))
        assert chunks.num_tokens == t + 1
        assert held_bytes(chunks.tensors()) == (t + 1 + chunks.spare) * per_token
    assert chunks.spare == TAIL_TOKENS - 5 and chunks.lengths[-1] == 5  # one tail filled, the next one open
    whole = torch.cat([p.dequantize(torch.float32) for p in chunks.pieces], dim=-2)
    end = 20 + TAIL_TOKENS + 5
    assert torch.equal(whole, quantize_int8(x[..., :end, :], 16).dequantize(torch.float32))
    chunks.append(quantize_int8(x[..., end:end + TAIL_APPEND + 1, :], 16))  # too many for a tail: sealed first
    end += TAIL_APPEND + 1
    assert chunks.spare == 0 and held_bytes(chunks.tensors()) == end * per_token
    chunks.append(quantize_int8(x[..., end:end + 1, :], 16))
    assert chunks.spare == TAIL_TOKENS - 1
    chunks.seal()
    assert chunks.spare == 0 and held_bytes(chunks.tensors()) == (end + 1) * per_token
    chunks.append(quantize_int8(x[..., end + 1:end + 2, :], 16))
    merged = chunks.merged()
    assert merged is not None and chunks.spare == 0 and held_bytes(merged.tensors()) == (end + 2) * per_token
    want = quantize_int8(x[..., :end + 2, :], 16).dequantize(torch.float32)
    assert torch.equal(merged.dequantize(torch.float32), want)


def test_a_growing_tail_describes_itself_as_a_piece_of_its_own_would() -> None:
    """Each decode step's view of the tail (``TokenChunk.head``, built without the dataclass's ``__init__``) carries
    the description the kernel reads — the same tensors, shapes and fields as describing that view afresh, its
    codes one cut shared with the view — never the whole reserve's, and a run given the chunk list's lengths
    starts its parts where asking each part would."""
    from kvbench.strategies._quantstore import TAIL_TOKENS, ChunkList

    from kvbench import blockattn
    from kvbench.quantizers import quantize_int8

    x = torch.randn(1, 2, 40 + TAIL_TOKENS, 16, generator=torch.Generator().manual_seed(2))
    chunks = ChunkList()
    chunks.append(quantize_int8(x[..., :40, :], 16))
    for t in range(40, 40 + TAIL_TOKENS - 1):
        chunks.append(quantize_int8(x[..., t:t + 1, :], 16))
        view = chunks.pieces[-1]
        got, fresh = view.fused(), view._describe()
        assert got is not None and fresh is not None and got is not chunks._tail.fused()
        assert got.data is view.codes and got.data.shape[-2] == t - 39
        for field in ("data", "scale", "zero"):
            a, b = getattr(got, field), getattr(fresh, field)
            assert (a is None) == (b is None)
            if a is not None:
                assert a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()
        assert (got.bits, got.mode, got.tg, got.cg, got.width) == (fresh.bits, fresh.mode, fresh.tg, fresh.cg,
                                                                     fresh.width)
        given = blockattn.TokenRun(chunks.pieces, 2, chunks.lengths)
        asked = blockattn.TokenRun(chunks.pieces, 2)
        assert given.starts == asked.starts and given.num_tokens == asked.num_tokens == t + 1


def test_a_chunked_prefill_leaves_a_quantized_store_holding_exactly_its_tokens() -> None:
    """``compact`` (called after each chunk of a chunked prefill) seals the tails, so a store measured after its
    prefill holds no reserved slot however small the chunks."""
    from kvbench.strategies import build
    from kvbench.strategies._quantstore import TAIL_TOKENS

    for name in ("int8", "fp8", "bfp"):
        store = build(name).new_layer(0, 1)
        k, v = torch.randn(1, 2, 24, 16).to(torch.bfloat16), torch.randn(1, 2, 24, 16).to(torch.bfloat16)
        store.prefill(k[..., :8, :], v[..., :8, :], None)
        chunks = [store.kc, store.vc] if name == "fp8" else [store.ks.chunks, store.vs.chunks]
        for t in range(8, 24, 2):
            q = torch.randn(1, 2, 2, 16).to(torch.bfloat16)
            store.attend(q, k[..., t:t + 2, :], v[..., t:t + 2, :], None, 0.25)  # what a chunk's attention calls
            assert all(c.spare == TAIL_TOKENS - 2 for c in chunks), name  # a 2-token chunk opened a tail
            store.compact()
            assert all(c.spare == 0 for c in chunks), name


def test_a_token_written_into_the_tail_is_the_piece_encoding_it_gives_bit_for_bit() -> None:
    """``ChunkList.write`` (int8's token axis: ``SymmetricInt8.write``, the native quantizer writing into the
    tail's reserve) leaves the same codes, scales, pieces and kernel descriptions as appending each token encoded
    as a piece of its own; where it cannot write (no tail open, a tail without room) it writes nothing."""
    from kvbench.strategies._quantstore import TAIL_APPEND, TAIL_TOKENS, ChunkList

    from kvbench import fused
    from kvbench.errors import KVBenchError
    from kvbench.quantizers import quantize_int8

    if fused.native() is None:
        pytest.skip("no native kernel here: the tail is written by copying pieces")
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(1, 3, 2 * TAIL_TOKENS + 50, 64, generator=gen) * 3).to(torch.bfloat16)
    x[..., 30, :] = 0  # a token of zeros: scale 0, codes 0
    written, appended = ChunkList(), ChunkList()
    assert not written.write(x[..., :1, :]), "no tail open: nothing written"
    for chunks in (written, appended):
        chunks.append(quantize_int8(x[..., :20, :], 64))
    assert not written.write(x[..., 20:21, :]) and written.num_tokens == 20, "a first piece is never a tail"
    for chunks in (written, appended):
        chunks.append(quantize_int8(x[..., 20:21, :], 64))  # opens the tail
    for t in range(21, x.shape[-2]):
        if not written.write(x[..., t:t + 1, :]):
            written.append(quantize_int8(x[..., t:t + 1, :], 64))
        appended.append(quantize_int8(x[..., t:t + 1, :], 64))
        assert written.lengths == appended.lengths and written.spare == appended.spare
    for a, b in zip(written.pieces, appended.pieces, strict=True):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
        fa, fb = a.fused(), b._describe()
        assert fa is not None and fb is not None
        assert torch.equal(fa.data, fb.data) and torch.equal(fa.scale, fb.scale) and (fa.tg, fa.cg) == (fb.tg, fb.cg)
    big = x[..., :TAIL_TOKENS + 1, :]
    before = written.lengths[-1]
    assert not written.write(big) and written.lengths[-1] == before, "more tokens than the tail has room for"
    fresh = ChunkList()
    fresh.append(quantize_int8(x[..., :20, :], 64))
    fresh.append(quantize_int8(x[..., 20:21, :], 64))
    assert fresh.spare == TAIL_TOKENS - 1
    assert not fresh.write(x[..., 21:22 + TAIL_APPEND, :]), "more tokens than append puts into a tail: its pieces"
    with pytest.raises(KVBenchError):  # checked as quantize_int8 checks it
        written.write(torch.full((1, 3, 1, 64), float("nan")))


def test_a_batchs_rows_written_in_one_call_are_each_rows_own_write_bit_for_bit() -> None:
    """``ChunkList.write_rows`` (a decode step's rows, each into its own sequence's tail, by the vector kernel's
    ``quantize_int8_token_rows_into`` in one call) leaves every row's codes, scales, lengths and pieces as its own
    ``write`` does, tails at different fills included; it writes nothing where one row cannot be written (no tail
    open, a tail without room) or the reader has no such call; and the open tail, read up to its filled slots
    (``read_parts``), is described as its cut view is."""
    from kvbench.strategies._quantstore import TAIL_TOKENS, ChunkList, FilledTail

    from kvbench import fused
    from kvbench.errors import KVBenchError
    from kvbench.quantizers import quantize_int8

    fused.choose("simd")
    try:
        if fused.rows_native() is None:
            pytest.skip("no vector kernel here: rows are written one by one")
        gen = torch.Generator().manual_seed(5)
        rows, steps = 4, TAIL_TOKENS + 7
        x = (torch.randn(rows, 3, 40 + steps, 64, generator=gen) * 2).to(torch.bfloat16)
        starts = [20, 21, 33, 40]  # prefix lengths: tails opened at different steps, so filled unevenly
        together, alone = [ChunkList() for _ in range(rows)], [ChunkList() for _ in range(rows)]
        for r in range(rows):
            for chunks in (together[r], alone[r]):
                chunks.append(quantize_int8(x[r:r + 1, :, :starts[r] - 1, :], 64))
                chunks.append(quantize_int8(x[r:r + 1, :, starts[r] - 1:starts[r], :], 64))  # opens the tail
        for t in range(steps):
            xs = [x[r:r + 1, :, starts[r] + t:starts[r] + t + 1, :] for r in range(rows)]
            # a tail fills up at a different step in each row: while one is closed, none is written together
            can = all(c._tail is not None and c.lengths[-1] < TAIL_TOKENS for c in together)
            ok = ChunkList.write_rows(together, xs)
            assert ok == can
            for r in range(rows):
                for chunks in ([alone[r]] if ok else [alone[r], together[r]]):
                    if not chunks.write(xs[r]):
                        chunks.append(quantize_int8(xs[r], 64))
            for r in range(rows):
                assert together[r].lengths == alone[r].lengths
                parts = together[r].read_parts()
                if isinstance(parts[-1], FilledTail):
                    cut, view = parts[-1].fused().cut(), together[r].pieces[-1].fused()
                    assert torch.equal(cut.data, view.data) and torch.equal(cut.scale, view.scale)
                for a, b in zip(together[r].pieces, alone[r].pieces, strict=True):
                    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
        open_ = [c for c in together if c._tail is not None]
        assert len(open_) >= 2, "tails still open at the end"
        before = [c.lengths[-1] for c in open_]
        assert not ChunkList.write_rows([*open_[:2], ChunkList()], xs[:3]), "a row with no tail"
        assert [c.lengths[-1] for c in open_] == before, "nothing written"
        with pytest.raises(KVBenchError):  # checked as quantize_int8 checks it
            ChunkList.write_rows(open_[:2], [torch.full((1, 3, 1, 64), float("nan"))] * 2)
        fused.choose("fused")  # the first kernel has no such call: nothing written, the caller writes row by row
        assert not ChunkList.write_rows(open_[:2], xs[:2]) and [c.lengths[-1] for c in open_[:2]] == before[:2]
    finally:
        fused.choose("auto")


@pytest.mark.parametrize("name", ["int8", "fp8", "bfp", "int4", "int2"])
def test_a_growing_tails_cut_description_is_the_description_of_its_tokens(name: str) -> None:
    """``TokenChunk.head`` describes a tail's filled slots by cutting the reserve's description
    (``Fused.head``): the same tensors, layout and parameters as describing the view anew, for every format whose
    chunks go into a tail."""
    from kvbench.strategies import build

    store = build(name).new_layer(0, 1)
    gen = torch.Generator().manual_seed(4)
    k, v = (torch.randn(1, 2, 240, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    store.prefill(k[..., :200, :], v[..., :200, :], None)  # past KIVI's 128-token residual
    for t in range(200, 240):
        store.attend(torch.randn(1, 4, 1, 64).to(torch.bfloat16), k[..., t:t + 1, :], v[..., t:t + 1, :], None, 0.125)
    lists = [s.chunks for s in store._streams()] if hasattr(store, "_streams") else [store.kc, store.vc]
    checked = 0
    for chunks in lists:
        for piece in chunks.pieces:
            got, want = piece.fused(), piece._describe()
            assert (got is None) == (want is None)
            if got is None:
                continue
            for a, b in ((got.data, want.data), (got.scale, want.scale), (got.zero, want.zero)):
                assert (a is None) == (b is None)
                if a is not None:
                    assert a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()
            assert (got.bits, got.mode, got.tg, got.cg) == (want.bits, want.mode, want.tg, want.cg)
            checked += 1
    assert checked
