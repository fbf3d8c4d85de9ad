"""Token-level haystacks: filler tokens drawn from real documents, with statements woven in at depths.

Samples are spread over the documents: sample ``i``'s primary document (the first one its filler is
drawn from) is ``order[i % D]`` of a seeded permutation of the ``D`` documents, so no document is the
primary one of more than ceil(n / D) of ``n`` samples, and none twice before every one has been used.
The permutation takes the works round-robin (one part of every work before a second part of any).

Everything works on token ids so lengths are exact. Inserted statements are placed at a requested
position and then snapped, within ``snap`` tokens, to the most natural break in the filler nearby
(paragraph > line > sentence > any token), so the insert does not split a word when it can be avoided.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbench.errors import KVBenchError
from kvbench.tasks.corpora import Document
from kvbench.tasks.prompt import encode

DOC_SEPARATOR = "\n\n"


@dataclass
class Filler:
    """Filler token ids and where they came from (document ids and character offsets)."""

    ids: list[int]
    sources: list[dict[str, Any]]  # doc_id, char_start, token_start (within ``ids``)

    @property
    def document_id(self) -> str:
        """The primary document: the one the filler starts in."""
        return self.sources[0]["doc_id"]

    @property
    def work_id(self) -> str:
        """The whole work the primary document was cut from (itself when it is a whole work): parts of one
        article or play are not independent, so intervals cluster on the work (spec §2)."""
        return self.sources[0].get("work") or self.document_id

    def truncate(self, n_tokens: int) -> Filler:
        """The first ``n_tokens`` ids, with the sources that still contribute to them."""
        return Filler(self.ids[:n_tokens], [s for s in self.sources if s["token_start"] < n_tokens])


def _chars_per_token(tokenizer: Any, text: str) -> float:
    sample = text[:4000]
    n = len(encode(tokenizer, sample))
    return max(1.0, len(sample) / max(1, n))


def _start_offsets(text: str) -> list[int]:
    """Paragraph starts; line starts when the text has few blank lines (hard-wrapped etexts)."""
    paras = [0] + [m.end() for m in re.finditer(r"\n\n+", text)]
    if len(paras) >= 10:
        return paras
    return [0] + [m.end() for m in re.finditer(r"\n", text)]


def spread_order(works: Sequence[str], key: str) -> list[int]:
    """A permutation of the document indices, seeded by ``key`` (a string: stable across processes).

    ``works[k]`` is document ``k``'s work. Works are visited in a shuffled order, round by round: each
    work's first (shuffled) document, then each work's second, ... so consecutive samples come from
    different works as long as there are works left in the round."""
    rng = random.Random(f"spread:{key}")
    by_work: dict[str, list[int]] = {}
    for k, work in enumerate(works):
        by_work.setdefault(work, []).append(k)
    groups = list(by_work.values())
    for group in groups:
        rng.shuffle(group)
    rng.shuffle(groups)
    return [g[r] for r in range(max(map(len, groups), default=0)) for g in groups if r < len(g)]


def primary_document(works: Sequence[str], index: int, key: str) -> int:
    """The primary document of sample ``index``: every document once per ``len(works)`` consecutive samples."""
    return spread_order(works, key)[index % len(works)]


def draw_filler(tokenizer: Any, docs: Sequence[Document], rng: random.Random, n_tokens: int,
                random_start: bool, index: int | None = None, spread_key: str = "") -> Filler:
    """``n_tokens`` ids of real text: one document from a random paragraph (or from its start), then
    further randomly chosen documents from their starts, joined by blank lines, until long enough.

    With ``index`` (the sample's index) the first document is :func:`primary_document` of the
    ``spread_key`` permutation; without it, a random one."""
    if not docs:
        raise KVBenchError("no documents to draw filler text from")
    ids: list[int] = []
    sources: list[dict[str, Any]] = []
    unused = list(range(len(docs)))
    first = None if index is None else primary_document([d.work for d in docs], index, spread_key)
    sep = encode(tokenizer, DOC_SEPARATOR)
    while len(ids) < n_tokens:
        if not unused:  # every document used once already: allow repeats rather than fail
            unused = list(range(len(docs)))
        if first is not None and not sources:
            idx = first
            unused.remove(first)
        else:
            idx = unused.pop(rng.randrange(len(unused)))
        doc = docs[idx]
        need = n_tokens - len(ids)
        start = 0
        cpt = _chars_per_token(tokenizer, doc.text)
        if random_start and not sources:
            # Prefer a start that leaves room for the whole filler in this one document.
            room = len(doc.text) - int(need * cpt * 1.1)
            offsets = [o for o in _start_offsets(doc.text) if o <= room] or [0]
            start = rng.choice(offsets)
        text = doc.text[start:]
        # Tokenize a window a bit larger than needed rather than the whole (possibly 400K-char) text.
        window = int(need * cpt * 1.3) + 64
        while True:
            piece = encode(tokenizer, text[:window])
            if len(piece) > need or window >= len(text):
                break
            window *= 2
        if ids:
            ids.extend(sep)
        sources.append({"doc_id": doc.doc_id, "work": doc.work, "char_start": start, "token_start": len(ids)})
        ids.extend(piece[: max(0, n_tokens - len(ids))])
    return Filler(ids=ids[:n_tokens], sources=sources)


def break_ranks(tokenizer: Any, ids: Sequence[int]) -> list[int]:
    """Rank of cutting before ``ids[k]`` for k in 0..len: 3 paragraph, 2 line, 1 sentence, 0 other."""
    cache: dict[int, str] = {}

    def text(i: int) -> str:
        if i not in cache:
            cache[i] = tokenizer.decode([i])
        return cache[i]

    pieces = [text(int(i)) for i in ids]
    ranks = [3]
    for k in range(1, len(pieces)):
        prev, nxt = pieces[k - 1], pieces[k]
        # A blank line may be one token ("\n\n") or two ("...\n", "\n").
        if ((pieces[k - 2] if k >= 2 else "\n") + prev).endswith("\n\n"):
            ranks.append(3)
        elif prev.endswith("\n"):
            ranks.append(2)
        elif prev.rstrip("\"')").endswith((".", "!", "?")) and nxt[:1] in (" ", "\n"):
            ranks.append(1)
        else:
            ranks.append(0)
    ranks.append(3)
    return ranks


@dataclass
class Insert:
    """A statement to weave in: its token ids and the requested start within the woven region."""

    ids: list[int]
    target: int
    role: str


def weave(filler: Sequence[int], ranks: Sequence[int], inserts: Sequence[Insert],
          snap: int) -> tuple[list[int], list[int]]:
    """Interleave ``inserts`` into ``filler``; return the region and each insert's actual start.

    Targets are positions in the final region (filler plus inserts). Each insert is cut into the
    filler at the best-ranked break within ``snap`` tokens of its target, never before the previous
    insert, so the order of inserts is kept and ``len(region) == len(filler) + sum(len(inserts))``.
    """
    order = sorted(range(len(inserts)), key=lambda i: (inserts[i].target, i))
    starts = [0] * len(inserts)
    region: list[int] = []
    prev_cut = 0
    offset = 0  # tokens of inserts already placed before the current cut
    for i in order:
        ins = inserts[i]
        want = min(max(ins.target - offset, prev_cut), len(filler))
        lo, hi = max(prev_cut, want - snap), min(len(filler), want + snap)
        cut = max(range(lo, hi + 1), key=lambda k: (ranks[k], -abs(k - want), -k))
        region.extend(filler[prev_cut:cut])
        starts[i] = len(region)
        region.extend(ins.ids)
        offset += len(ins.ids)
        prev_cut = cut
    region.extend(filler[prev_cut:])
    return region, starts


def spread_targets(rng: random.Random, window: tuple[int, int], fixed: Sequence[tuple[int, int]],
                   lengths: Sequence[int], min_gap: int) -> list[int] | None:
    """Random starts for inserts of ``lengths`` inside ``window`` = [lo, hi) that keep ``min_gap``
    tokens from each other and from the ``fixed`` (start, length) spans; None when they do not fit."""
    lo, hi = window
    placed = list(fixed)
    out: list[int] = []
    for length in lengths:
        if hi - length < lo:
            return None
        for _ in range(2000):
            t = rng.randint(lo, hi - length)
            if all(t + length + min_gap <= s or s + n + min_gap <= t for s, n in placed):
                break
        else:
            return None
        placed.append((t, length))
        out.append(t)
    return out
