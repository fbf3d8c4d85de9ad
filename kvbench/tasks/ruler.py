"""``ruler``: RULER's synthetic subtasks, generated natively at an exact token length.

RULER (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language Models?", 2024;
generator: github.com/NVIDIA/RULER, ``scripts/data/synthetic/*.py``, templates in
``scripts/data/synthetic/constants.py``, metrics in ``scripts/eval/synthetic/constants.py``) tests retrieval,
multi-hop tracing and aggregation with synthetic haystacks. kvbench writes its own generator after RULER's
description and public templates:

* ``niah_single_{1,2,3}``, ``niah_multikey_{1,2,3}``, ``niah_multivalue``, ``niah_multiquery`` — needles
  "One of the special magic numbers for <key> is: <value>." in a noise haystack ("The grass is green. ..."),
  an essay-like haystack (real text from kvbench's own corpora: ``task.haystack_corpus``, default
  ``papers``; RULER uses Paul Graham's essays, which are not available here) or a haystack made of other
  needles; metric ``string_match_all`` (the fraction of expected values found in the reply).
* ``vt`` — variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... (4 hops) hidden in the noise
  haystack; the answer is every variable in the chain (``string_match_all``).
* ``cwe`` — common-word extraction: a numbered word list in which 10 words appear 30 times and the others
  3 times (6 and 1 below a 4K window, as RULER); the answer is the 10 common words (``string_match_all``).
* ``fwe`` — frequent-word extraction: coded six-letter words drawn from a Zipf distribution (alpha 2), the
  most frequent one being ``...``; the answer is the next three (``string_match_all``).

Differences from RULER (also in docs/tasks.md, section "RULER"): the length is exact in model tokens (RULER
grows the haystack in steps until the next step would overflow ``max_seq_length``), so the haystack is cut
mid-sentence at its end and the list subtasks end in up to one entry's worth of newline tokens; the essay
haystack is kvbench's corpus text; the word lists are kvbench's own (:mod:`kvbench.tasks._ruler_words`); no
in-context example is prepended to ``vt``/``cwe``/``fwe``; the prompt is framed by the model's chat template
when it has one. Each sample draws from its own string-seeded ``random.Random`` (never global state).

Why one module of this length: the RULER subtasks share the prompt pieces, the seeded draws and the haystack
builder defined first; each subtask (NIAH, vt, cwe/fwe) is one section after them.
"""

from __future__ import annotations

import random
import string
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from kvbench.errors import KVBenchError
from kvbench.tasks._ruler_words import ADJECTIVE_WORDS, NOUN_WORDS, WORDS
from kvbench.tasks.base import Sample, TaskInputs, register_task
from kvbench.tasks.haystack import Insert, break_ranks, draw_filler, weave
from kvbench.tasks.prompt import PromptPieces, chat_frame, encode, has_chat_template, leading_special_ids
from kvbench.tasks.suite import option

#: Bumped whenever a change to this module changes the samples it generates (part of the run identity).
GENERATOR_VERSION = 1

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {vtype} for {key} is: {value}."
#: RULER's needle depths: 40 points from 0 to 100 percent.
DEPTH_GRID = tuple(round(100 * k / 39) / 100 for k in range(40))
HAYSTACKS = ("noise", "essay", "needle")


@dataclass(frozen=True)
class Niah:
    """One NIAH configuration of RULER's ``synthetic.yaml``."""

    haystack: str
    key_type: str
    value_type: str
    keys: int = 1
    values: int = 1
    queries: int = 1


NIAH: dict[str, Niah] = {
    "niah_single_1": Niah("noise", "words", "numbers"),
    "niah_single_2": Niah("essay", "words", "numbers"),
    "niah_single_3": Niah("essay", "words", "uuids"),
    "niah_multikey_1": Niah("essay", "words", "numbers", keys=4),
    "niah_multikey_2": Niah("needle", "words", "numbers"),
    "niah_multikey_3": Niah("needle", "uuids", "uuids"),
    "niah_multivalue": Niah("essay", "words", "numbers", values=4),
    "niah_multiquery": Niah("essay", "words", "numbers", keys=4, queries=4),
}
SUBTASKS = (*NIAH, "vt", "cwe", "fwe")
#: Greedy tokens decoded per subtask (RULER generates 128 for NIAH, 30 for vt, 120 for cwe, 50 for fwe;
#: NIAH here gets what its answers need after the answer prefix, since decoding dominates CPU runs).
MAX_NEW = {"niah_single_1": 16, "niah_single_2": 16, "niah_single_3": 40, "niah_multikey_1": 16,
           "niah_multikey_2": 16, "niah_multikey_3": 40, "niah_multivalue": 64, "niah_multiquery": 64,
           "vt": 30, "cwe": 120, "fwe": 50}
VT_HOPS = 4
CWE_COMMON = 10
FWE_ALPHA = 2.0
FWE_WORD_LEN = 6

RULER_DEFAULTS: dict[str, Any] = {
    "subtask": "niah_single_1",
    "context_tokens": 4096,
    "n_samples": 10,
    "query_aware": True,  # RULER's own setting (question after the context, uncompressed); kvpress: false
    "answer_prefix": True,
    "depths": [],  # single-needle subtasks: depth grid (sample i uses depths[i % len]); empty: RULER's random
    "haystack_corpus": "papers",  # essay-like haystack: legal | papers | fiction
    "seed": 0,
    "max_new_tokens": None,  # None: the subtask's default (MAX_NEW)
}


@dataclass
class Draw:
    """What a sample asks (drawn first, so the prompt's size is known before the haystack is built)."""

    instruction: str  # ends with the separator that precedes the document
    question: str
    answer_prefix: str
    answers: list[str]
    data: dict[str, Any]
    counted: tuple[str, ...] = ()  # strings that must occur exactly once in the document


# ------------------------------------------------------------------------------------------- prompt


def pieces(tokenizer: Any, instruction: str, question: str, answer_prefix: str) -> PromptPieces:
    """RULER's layout: instruction, document, question, then the answer prefix opening the reply.

    ``instruction`` ends with the separator that precedes the document; the question follows it on a new
    line. With a chat template the user turn holds instruction, document and question.
    """
    qtext = f"\n{question}"
    if has_chat_template(tokenizer):
        before, after = chat_frame(tokenizer)
        return PromptPieces("chat", encode(tokenizer, before) + encode(tokenizer, instruction),
                            encode(tokenizer, qtext), encode(tokenizer, after), encode(tokenizer, answer_prefix),
                            " " if answer_prefix else "")
    return PromptPieces("plain", leading_special_ids(tokenizer) + encode(tokenizer, instruction),
                        encode(tokenizer, qtext), [] if answer_prefix else encode(tokenizer, "\nAnswer:"),
                        encode(tokenizer, f" {answer_prefix}") if answer_prefix else [], " ")


# ------------------------------------------------------------------------------------------- draws


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return _number(rng)
    if kind == "words":
        return f"{rng.choice(ADJECTIVE_WORDS)}-{rng.choice(NOUN_WORDS)}"
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _unique(rng: random.Random, kind: str, n: int, taken: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        v = _value(rng, kind)
        if v not in taken:
            taken.add(v)
            out.append(v)
    return out


def _join(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


# ------------------------------------------------------------------------------------------- haystacks


def _line_filler(tokenizer: Any, lines: Any, n_tokens: int) -> tuple[list[int], int]:
    """Lines (``text`` + newline, each tokenized on its own) until ``n_tokens``; the last one is cut.
    Returns the ids and where the last complete line ends (nothing is inserted after it)."""
    ids: list[int] = []
    nl = encode(tokenizer, "\n")
    boundary = 0
    for text in lines:
        boundary = len(ids)
        ids.extend(encode(tokenizer, text) + nl)
        if len(ids) >= n_tokens:
            break
    if len(ids) == n_tokens:
        boundary = n_tokens
    return ids[:n_tokens], min(boundary, n_tokens)


def _weave_at_depths(tokenizer: Any, filler: list[int], last: int, inserts: list[list[int]],
                     depths: list[float], snap: int) -> tuple[list[int], list[int]]:
    """Insert ``inserts`` (in order) at ``depths`` (ascending fractions of the filler), each moved to the
    best break within ``snap`` tokens and never past ``last`` (a cut line stays at the end)."""
    ranks = break_ranks(tokenizer, filler)
    for k in range(last + 1, len(ranks)):
        ranks[k] = -1
    placed, offset = [], 0
    for ids, d in zip(inserts, depths, strict=True):
        placed.append(Insert(ids, min(round(d * len(filler)), last) + offset, "needle"))
        offset += len(ids)
    return weave(filler, ranks, placed, snap)


def _depths(rng: random.Random, cfg_depths: list[float], index: int, n: int) -> list[float]:
    if cfg_depths:
        return [cfg_depths[index % len(cfg_depths)]]
    return sorted(rng.sample(DEPTH_GRID, n))


# ------------------------------------------------------------------------------------------- NIAH


def _niah_draw(spec: Niah, rng: random.Random) -> Draw:
    taken: set[str] = set()
    keys = _unique(rng, spec.key_type, max(spec.keys, spec.queries), taken)
    values = {k: _unique(rng, spec.value_type, spec.values, taken) for k in keys}
    needles = [(k, v) for k in keys for v in values[k]]
    rng.shuffle(needles)
    queried = rng.sample(keys, spec.queries)
    answers = [v for k in queried for v in values[k]]
    vtype, one = spec.value_type, spec.value_type[:-1]
    # RULER switches the template to the singular when one value is asked for.
    if spec.queries * spec.values > 1:
        instruction = (f"Some special magic {vtype} are hidden within the following text. Make sure to memorize "
                       f"it. I will quiz you about the {vtype} afterwards.\n")
        question = f"What are all the special magic {vtype} for {_join(queried)} mentioned in the provided text?"
        prefix = f"The special magic {vtype} for {_join(queried)} mentioned in the provided text are"
    else:
        instruction = (f"A special magic {one} is hidden within the following text. Make sure to memorize it. "
                       f"I will quiz you about the {one} afterwards.\n")
        question = f"What is the special magic {one} for {queried[0]} mentioned in the provided text?"
        prefix = f"The special magic {one} for {queried[0]} mentioned in the provided text is"
    data = {"needles": needles, "queried": queried, "taken": taken}
    return Draw(instruction, question, prefix, answers, data, counted=tuple(v for _, v in needles))


def _niah_document(spec: Niah, draw: Draw, rng: random.Random, tokenizer: Any, budget: int,
                   ctx: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    needles, taken = draw.data["needles"], draw.data["taken"]
    vtype = spec.value_type
    texts = [NEEDLE.format(vtype=vtype, key=k, value=v) for k, v in needles]
    depths = _depths(rng, ctx["depths"] if len(needles) == 1 else [], ctx["index"], len(needles))
    sources: list[dict[str, Any]] = []
    if spec.haystack == "essay":
        # A sentence among the essay's sentences, as RULER inserts it.
        ins = [encode(tokenizer, f" {t} ") for t in texts]
        filler_len = _filler_budget(budget, ins)
        filler = draw_filler(tokenizer, ctx["docs"](), random.Random(f"{ctx['rng_name']}:filler"), filler_len,
                             random_start=True)
        ids, last, snap, sources = filler.ids, filler_len, 16, filler.sources
    else:
        # A line among lines: repeated noise, or other needles (other keys and values) for multikey_2/3.
        nl = encode(tokenizer, "\n")
        ins = [encode(tokenizer, t) + nl for t in texts]
        filler_len = _filler_budget(budget, ins)
        if spec.haystack == "noise":
            lines: Iterator[str] = repeat(NOISE)
        else:
            lines = (NEEDLE.format(vtype=vtype, key=_unique(rng, spec.key_type, 1, taken)[0],
                                   value=_unique(rng, vtype, 1, taken)[0]) for _ in repeat(None))
        ids, last = _line_filler(tokenizer, lines, filler_len)
        snap = max(map(len, ins)) + 32  # always reaches a line start
    region, starts = _weave_at_depths(tokenizer, ids, last, ins, depths, snap)
    q = next(i for i, (k, _) in enumerate(needles) if k == draw.data["queried"][0])
    meta: dict[str, Any] = {
        "haystack": spec.haystack, "needles": len(needles), "needle_keys": [k for k, _ in needles],
        "needle_values": [v for _, v in needles], "query_keys": list(draw.data["queried"]),
        "requested_depths": depths, "needle_offsets": starts, "query_needle_offset": starts[q],
        "needle_tokens": len(ins[q]),
        "source_docs": [s["doc_id"] for s in sources], "source_offsets": [s["char_start"] for s in sources],
    }
    if len(needles) == 1:
        # Only a single needle has one depth; the needle map and depth analyses read these two keys.
        meta.update(depth=depths[0], needle_depth=starts[0] / max(1, filler_len))
    return region, meta


def _filler_budget(budget: int, inserts: list[list[int]]) -> int:
    n = budget - sum(map(len, inserts))
    if n < 32:
        raise KVBenchError(f"{budget} document tokens are too few for {len(inserts)} needle(s) "
                           f"({budget - n} tokens); raise task.context_tokens")
    return n


# ------------------------------------------------------------------------------------------- vt


def _vt_draw(rng: random.Random) -> Draw:
    names: list[str] = []
    while len(names) < VT_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10_000, 99_999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(VT_HOPS)]
    return Draw("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n",
                f"Question: Find all variables that are assigned the value {value} in the text above.",
                f"Answer: According to the chain(s) of variable assignment in the text above, {len(names)} variables "
                f"are assigned the value {value}, they are:", names, {"chain": chain, "value": value},
                counted=(value,))


def _vt_document(draw: Draw, rng: random.Random, tokenizer: Any, budget: int,
                 ctx: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    nl = encode(tokenizer, "\n")
    ins = [encode(tokenizer, t) + nl for t in draw.data["chain"]]
    ids, last = _line_filler(tokenizer, repeat(NOISE), _filler_budget(budget, ins))
    depths = sorted(rng.sample(DEPTH_GRID, len(ins)))  # the chain in order, at random lines
    region, starts = _weave_at_depths(tokenizer, ids, last, ins, depths, max(map(len, ins)) + 32)
    return region, {"haystack": "noise", "chain": draw.data["chain"], "requested_depths": depths,
                    "needle_offsets": starts}


# ------------------------------------------------------------------------------------------- cwe / fwe


def _pad(tokenizer: Any, ids: list[int], budget: int) -> list[int]:
    """Fill the last few tokens (less than one list entry) with newlines, so the length is exact."""
    nl = encode(tokenizer, "\n") or [0]
    while len(ids) < budget:
        ids.extend(nl[: budget - len(ids)])
    return ids


CWE_DRAW = Draw("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n", "Question: What are the 10 most common words in the above list?",
                "Answer: The top 10 words that appear most often in the list are:", [], {})


def _cwe_document(draw: Draw, rng: random.Random, tokenizer: Any, budget: int,
                  ctx: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    common_n, rare_n = (30, 3) if ctx["window"] >= 4096 else (6, 1)  # RULER's repetitions at / below 4K
    words = rng.sample(WORDS, len(WORDS))
    common, pool = words[:CWE_COMMON], words[CWE_COMMON:]
    draw.answers[:] = common
    wlen = {w: len(encode(tokenizer, f" {w}")) for w in words}
    nlen: dict[int, int] = {}

    def number(n: int) -> str:
        return f" {n}." if n > 1 else f"{n}."

    def num_len(n: int) -> int:
        if n not in nlen:
            nlen[n] = len(encode(tokenizer, number(n)))
        return nlen[n]

    # Token count does not depend on the order of the entries, so the list is sized before it is shuffled.
    total = sum(num_len(n) for n in range(1, CWE_COMMON * common_n + 1)) + common_n * sum(wlen[w] for w in common)
    if total > budget:
        raise KVBenchError(f"{budget} document tokens are too few for cwe's {CWE_COMMON} common words "
                           f"({total} tokens); raise task.context_tokens")
    used = 0
    while True:
        if used == len(pool):
            raise KVBenchError(f"cwe at task.context_tokens={ctx['context_tokens']} needs more than the "
                               f"{len(WORDS)} distinct words kvbench's list holds; use a shorter context")
        base = CWE_COMMON * common_n + used * rare_n
        extra = sum(num_len(base + j) for j in range(1, rare_n + 1)) + rare_n * wlen[pool[used]]
        if total + extra > budget:
            break
        total, used = total + extra, used + 1
    entries = common * common_n + pool[:used] * rare_n
    rng.shuffle(entries)
    ids: list[int] = []
    for n, w in enumerate(entries, start=1):
        ids += encode(tokenizer, number(n)) + encode(tokenizer, f" {w}")
    return _pad(tokenizer, ids, budget), {
        "haystack": "word_list", "entries": len(entries), "common_repeats": common_n, "rare_repeats": rare_n,
        "rare_words": used, "pad_tokens": budget - total}


FWE_DRAW = Draw("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words.", "Question: Do not provide any explanation. Please ignore the dots "
                "'....'. What are the three most frequently appeared words in the above coded text?",
                "Answer: According to the coded text above, the three most frequently appeared words are:", [], {})


def _fwe_document(draw: Draw, rng: random.Random, tokenizer: Any, budget: int,
                  ctx: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    from scipy.special import zeta

    size = max(16, ctx["window"] // 50)  # RULER's vocabulary size: max_seq_length // 50
    vocab: list[str] = []
    while len(vocab) < size:
        w = "".join(rng.choices(string.ascii_lowercase, k=FWE_WORD_LEN))
        if w not in vocab:
            vocab.append(w)
    vocab[0] = "..."  # the most frequent "word" is noise, as in RULER
    draw.answers[:] = vocab[1:4]
    wlen = [len(encode(tokenizer, f" {w}")) for w in vocab]
    z = float(zeta(FWE_ALPHA))

    def counts(n_words: int) -> list[int]:
        return [int(n_words * k ** -FWE_ALPHA / z) for k in range(1, size + 1)]

    def tokens(n_words: int) -> int:
        return sum(c * n for c, n in zip(counts(n_words), wlen, strict=True))

    lo, hi = 0, max(2, budget)
    while tokens(hi) <= budget:
        hi *= 2
    while hi - lo > 1:  # the largest word count whose text fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if tokens(mid) <= budget else (lo, mid)
    c = counts(lo)
    if not c[1] > c[2] > c[3] > c[4]:
        raise KVBenchError(f"{budget} document tokens are too few for fwe's top three words to be distinct; "
                           "raise task.context_tokens")
    words = [w for w, k in zip(vocab, c, strict=True) for _ in range(k)]
    rng.shuffle(words)
    ids: list[int] = []
    for w in words:
        ids += encode(tokenizer, f" {w}")
    return _pad(tokenizer, ids, budget), {"haystack": "coded_words", "words": len(words), "top_counts": c[:5],
                                          "pad_tokens": budget - tokens(lo)}


# ------------------------------------------------------------------------------------------- task


def _draw(sub: str, rng: random.Random) -> Draw:
    if sub in NIAH:
        return _niah_draw(NIAH[sub], rng)
    if sub == "vt":
        return _vt_draw(rng)
    base = CWE_DRAW if sub == "cwe" else FWE_DRAW
    return Draw(base.instruction, base.question, base.answer_prefix, [], {})


def _document(sub: str, draw: Draw, rng: random.Random, tokenizer: Any, budget: int,
              ctx: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    if sub in NIAH:
        return _niah_document(NIAH[sub], draw, rng, tokenizer, budget, ctx)
    builder = {"vt": _vt_document, "cwe": _cwe_document, "fwe": _fwe_document}[sub]
    return builder(draw, rng, tokenizer, budget, ctx)


def _options(cfg: Any) -> dict[str, Any]:
    o = {k: option(cfg, k, RULER_DEFAULTS) for k in RULER_DEFAULTS}
    if o["subtask"] not in SUBTASKS:
        raise KVBenchError(f"unknown task.subtask {o['subtask']!r}; valid: {', '.join(SUBTASKS)}")
    o["depths"] = [float(d) for d in (o["depths"] or [])]
    if any(not 0.0 <= d <= 1.0 for d in o["depths"]):
        raise KVBenchError(f"task.depths must be numbers in [0, 1] (got {o['depths']})")
    single = [s for s, n in NIAH.items() if max(n.keys, n.queries) * n.values == 1]
    if o["depths"] and o["subtask"] not in single:
        raise KVBenchError(f"task.depths applies to the single-needle subtasks ({', '.join(single)}), "
                           f"not {o['subtask']}")
    from kvbench.tasks.corpora import DOMAINS

    if o["haystack_corpus"] not in DOMAINS:
        raise KVBenchError(f"unknown task.haystack_corpus {o['haystack_corpus']!r}; valid: {', '.join(DOMAINS)}")
    if o["max_new_tokens"] is None:
        o["max_new_tokens"] = MAX_NEW[o["subtask"]]
    return o


def uses_corpus(cfg: Any) -> str | None:
    """The corpus domain the configured subtask's haystack is drawn from (None: generated text only)."""
    o = _options(cfg)
    spec = NIAH.get(o["subtask"])
    return o["haystack_corpus"] if spec is not None and spec.haystack == "essay" else None


def record_name(cfg: Any) -> str:
    """The task name records carry: one task per subtask (``ruler_niah_single_1``), as RULER reports them."""
    return f"ruler_{_options(cfg)['subtask']}"


ATTEMPTS = 8


def ruler_digest(cfg: Any) -> dict[str, Any]:
    """Run identity of a RULER task: generated from the seed by versioned code; essay haystacks read a corpus."""
    from kvbench.identity import _combine
    from kvbench.tasks.corpora import ARCHIVES, DOMAIN_ARCHIVES, EXTRACTOR_VERSION

    domain = uses_corpus(cfg)
    entries = {"generator": str(GENERATOR_VERSION)}
    if domain:
        entries.update({k: ARCHIVES[k].sha256 for k in DOMAIN_ARCHIVES[domain]}, extractor=str(EXTRACTOR_VERSION))
    return {"kind": "ruler", "corpus": domain, "digest": _combine(entries)}


@register_task("ruler", inputs=TaskInputs(digest=ruler_digest))
def build(cfg: Any, tokenizer: Any, max_context: int) -> list[Sample]:
    """``n_samples`` samples of ``task.subtask`` with ``len(prefix_ids) == context_tokens`` exactly."""
    o = _options(cfg)
    sub, ctx_tokens, seed, qa = o["subtask"], int(o["context_tokens"]), int(o["seed"]), bool(o["query_aware"])
    use_prefix, max_new = bool(o["answer_prefix"]), int(o["max_new_tokens"])
    corpus: list[Any] = []

    def docs() -> list[Any]:
        if not corpus:  # loaded only by the essay-haystack subtasks
            from kvbench.tasks.corpora import load_corpus

            corpus.extend(load_corpus(o["haystack_corpus"]))
        return corpus

    samples = []
    for i in range(int(o["n_samples"])):
        name = f"ruler:{sub}:{seed}:{i}"
        rng = random.Random(name)
        ctx = {"index": i, "depths": o["depths"], "docs": docs, "rng_name": name, "context_tokens": ctx_tokens,
               "window": ctx_tokens + max_new}
        for _ in range(ATTEMPTS):
            draw = _draw(sub, rng)
            pp = pieces(tokenizer, draw.instruction, draw.question, draw.answer_prefix if use_prefix else "")
            budget = pp.document_budget(ctx_tokens, qa)
            if budget < 64:
                raise KVBenchError(f"task.context_tokens={ctx_tokens} leaves {budget} document tokens after "
                                   f"RULER's {sub} prompt; use at least {ctx_tokens - budget + 256}")
            document, dmeta = _document(sub, draw, rng, tokenizer, budget, ctx)
            # A drawn value could, rarely, also occur in an essay haystack: draw again (from the same
            # generator, so still a pure function of the seed) until each occurs exactly once.
            text = tokenizer.decode(document)
            if all(text.count(a) == 1 for a in draw.counted):
                break
        else:
            raise KVBenchError(f"could not draw {sub} values that occur once in the haystack in {ATTEMPTS} tries")
        prefix, query = pp.assemble(document, qa)
        start = len(pp.head)
        meta = {"task": "ruler", "subtask": sub, "variant": "ruler", "template": pp.template, "seed": seed,
                "index": i, "context_tokens": len(prefix), "query_aware": qa, "answer_prefix": use_prefix,
                "question": draw.question, "answer_prefix_text": draw.answer_prefix if use_prefix else "",
                "document_span": [start, start + budget], "depth": None, "needle_token_index": None,
                "distractors": 0, "source_docs": [], **dmeta}
        if "query_needle_offset" in dmeta:
            meta["needle_token_index"] = start + dmeta["query_needle_offset"]
        samples.append(Sample(
            sample_id=f"ruler/{sub}/{i:03d}", prefix_ids=prefix, query_ids=query,
            gold_ids=pp.gold_ids(tokenizer, ", ".join(draw.answers)), answers=list(draw.answers),
            metric="string_match_all", max_new_tokens=max_new, metadata=meta))
    return samples
