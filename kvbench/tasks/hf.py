"""``hf``: question answering from a local Hugging Face dataset (LongBench, InfiniteBench or your own).

``task.dataset`` names a saved ``Dataset``/``DatasetDict`` (read with ``datasets.load_from_disk``), a data
file (``.json``/``.jsonl``/``.parquet``/``.arrow``/``.csv``, read with ``datasets.load_dataset(<format>,
data_files=...)``), a glob of such files, or a folder of them (``datasets.load_dataset(<folder>)``). Nothing
is downloaded. A field mapping names the context, question, answers, id and (optionally) per-row metric
columns; presets fill it in:

* ``longbench`` (Bai et al. 2023, github.com/THUDM/LongBench): ``context``, ``input``, ``answers``, ``_id``;
  the subset (the rows' ``dataset`` column, ``task.subset`` or the file name) picks LongBench's metric
  (``dataset2metric`` of its ``eval.py``) and answer length (``dataset2maxlen``), see :data:`LONGBENCH`;
* ``infinitebench`` (Zhang et al. 2024, github.com/OpenBMB/InfiniteBench): ``context``, ``input``, ``answer``,
  ``id``; the subset (file name, e.g. ``passkey``) picks the metric, see :data:`INFINITEBENCH`;
* ``scbench`` (Li et al. 2025, SCBench, github.com/microsoft/MInference/tree/main/scbench): ``context``, ``id`` and
  ``multi_turns: [{input, answer}, ...]``, every turn a question on the same compressed context (query-agnostic,
  ``task.shared_context`` = SCBench's multi-request or multi-turn mode); the subset (file name, e.g.
  ``scbench_kv``) picks the metric, see :data:`SCBENCH`.

Several questions per compressed context (``task.questions_per_context``, a row's ``multi_turns``): see
:mod:`kvbench.tasks.shared`.

Contexts longer than the budget are truncated in the middle (LongBench's convention: the first and last
halves are kept), in model tokens; ``metadata`` records the original length and whether it was cut. The run
identity digests every file read and, for a saved dataset, its fingerprints (:func:`dataset_digest`).
"""

from __future__ import annotations

import glob
import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

from kvbench.errors import KVBenchError
from kvbench.tasks.base import Sample, TaskInputs, answer_list, register_task
from kvbench.tasks.metrics import TEXT_METRICS
from kvbench.tasks.shared import Context, Question, document_meta, group_by_text, qa_samples, sharing
from kvbench.tasks.suite import option

PRESETS = ("none", "longbench", "infinitebench", "scbench")
FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
#: Column names per preset: context, question, answers, id (first present wins for "none").
#: ``turns``: a column of ``[{input, answer}, ...]`` (SCBench's ``multi_turns``), several questions on one context.
FIELDS: dict[str, dict[str, tuple[str, ...]]] = {
    "none": {"context": ("context",), "question": ("input", "question"), "answers": ("answers", "answer"),
             "id": ("_id", "id"), "turns": ("multi_turns",), "document": ("document_id",)},
    "longbench": {"context": ("context",), "question": ("input",), "answers": ("answers",), "id": ("_id",),
                  "turns": (), "document": ("document_id",)},
    "infinitebench": {"context": ("context",), "question": ("input",), "answers": ("answer",), "id": ("id",),
                      "turns": (), "document": ("document_id",)},
    "scbench": {"context": ("context",), "question": (), "answers": (), "id": ("id",), "turns": ("multi_turns",),
                "document": ("document_id",)},
}

#: LongBench subset -> (metric, max new tokens). Metrics follow LongBench's ``dataset2metric``: ``qa_f1_score``
#: is our ``f1`` (SQuAD token F1), ``rouge_score`` our ``rouge_l``, ``retrieval_score``/``count_score``/
#: ``code_sim_score`` ours of the same name; ``classification_score`` becomes ``substring`` (the label named in
#: the reply; LongBench gives 1/k when the reply names k labels, which needs its ``all_classes``).
LONGBENCH: dict[str, tuple[str, int]] = {
    "narrativeqa": ("f1", 128), "qasper": ("f1", 128), "multifieldqa_en": ("f1", 64), "hotpotqa": ("f1", 32),
    "2wikimqa": ("f1", 32), "musique": ("f1", 32), "triviaqa": ("f1", 32),
    "gov_report": ("rouge_l", 512), "qmsum": ("rouge_l", 512), "multi_news": ("rouge_l", 512),
    "samsum": ("rouge_l", 128), "trec": ("substring", 64), "passage_count": ("count_score", 32),
    "passage_retrieval_en": ("retrieval_score", 32), "lcc": ("code_sim", 64), "repobench-p": ("code_sim", 64),
}
#: LongBench's Chinese subsets score with jieba word segmentation, which kvbench does not ship.
LONGBENCH_ZH = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
#: InfiniteBench subset -> (metric, max new tokens): the retrieval tasks' first-number / exact checks become
#: ``substring``; ``longbook_qa_eng`` is F1 and ``longbook_sum_eng`` ROUGE-L as in InfiniteBench.
INFINITEBENCH: dict[str, tuple[str, int]] = {
    "passkey": ("substring", 6), "number_string": ("substring", 12), "kv_retrieval": ("substring", 50),
    "longbook_qa_eng": ("f1", 40), "longbook_choice_eng": ("substring", 40), "longbook_sum_eng": ("rouge_l", 1200),
    "longdialogue_qa_eng": ("substring", 40), "math_find": ("substring", 3), "code_debug": ("substring", 5),
    "code_run": ("substring", 5),
}

#: SCBench subset -> (metric, max new tokens), from its ``compute_scores.py`` and ``DATA_NAME_TO_MAX_NEW_TOKENS``:
#: the key-value, passkey, math-find, many-shot and English QA scorers check the gold in the reply (``substring``),
#: ``scbench_vt`` is ``string_match_all``, summaries ROUGE-L (SCBench: ROUGE-Lsum); the multiple-choice scorer
#: (first letter or option text) becomes ``substring``. ``scbench_repoqa`` (pass@1 over a similarity threshold)
#: and ``scbench_qa_chn`` (character F1) have no kvbench metric (None): they run once ``task.metric`` is set.
#: The two multi-task subsets name each turn's ``task``; their turns use that subset's entry.
SCBENCH: dict[str, tuple[str | None, int]] = {
    "scbench_kv": ("substring", 150), "scbench_kv_hard": ("substring", 150),
    "scbench_kv_compressible": ("substring", 150), "scbench_hashhop": ("substring", 150),
    "scbench_prefix_suffix": ("substring", 150), "scbench_passkey": ("substring", 15),
    "scbench_qa_eng": ("substring", 40), "scbench_choice_eng": ("substring", 40), "scbench_mf": ("substring", 5),
    "scbench_many_shot": ("substring", 10), "scbench_vt": ("string_match_all", 30),
    "scbench_summary": ("rouge_l", 200), "scbench_summary_with_needles": ("rouge_l", 800),
    "scbench_repoqa_and_kv": ("substring", 80), "scbench_repoqa": (None, 1024), "scbench_qa_chn": (None, 40),
}

HF_DEFAULTS: dict[str, Any] = {
    "preset": "none",
    "subset": None,  # LongBench/InfiniteBench subset (None: the rows' `dataset` column, else the file name)
    "split": None,  # DatasetDict split (None: `test` if present, else the only split)
    "context_field": None, "question_field": None, "answers_field": None, "id_field": None,
    "turns_field": None,  # a column of [{input, answer}, ...] per row (null: the preset's, `multi_turns`)
    "metric_field": None,  # a column naming each row's metric
    # the column naming the work a row's context is cut from (null: `document_id` when there is one): contexts of
    # one work are one cluster of the intervals (spec v1.2 §2.2); without it each context is its own
    "document_field": None,
    "metric": None,  # None: the preset's metric for the subset, else `substring`
    "context_tokens": 2048,
    "n_samples": 10,
    # null: false when questions share a context (questions_per_context > 1, or a row's turns), else true
    "query_aware": None,
    # K questions per compressed context: rows with the same context text are one context (its first K
    # questions); a row's turns are its questions (null: every turn of a turns row, else 1)
    "questions_per_context": None,
    "shared_context": "multi_request",  # multi_request | multi_turn: SCBench's two modes (kvbench/tasks/shared.py)
    "max_new_tokens": None,  # None: the preset's answer length for the subset, else 32
    "instruction": "Read the context and answer the question concisely.",
    "answer_prefix": "",
    "seed": 0,
    "dataset_name": None,  # the name records carry as `task` (None: hf_<subset or file stem>)
}


# ------------------------------------------------------------------------------------------- loading


def _path(cfg: Any) -> str:
    value = cfg.get("dataset", None)
    if not value or value == "???":
        raise KVBenchError("task hf needs task.dataset=<saved dataset dir | data file | folder of data files>")
    return str(Path(str(value)).expanduser())


def data_files(cfg: Any) -> list[Path]:
    """The files the dataset is read from (a saved dataset: every file of its folder), sorted."""
    path = _path(cfg)
    if any(c in path for c in "*?["):
        files = [Path(p) for p in glob.glob(path, recursive=True) if Path(p).is_file()]
    elif Path(path).is_dir():
        files = [p for p in Path(path).rglob("*") if p.is_file()
                 and not any(part.startswith(".") for part in p.relative_to(path).parts)]
    elif Path(path).is_file():
        files = [Path(path)]
    else:
        raise KVBenchError(f"task.dataset={path!r} does not exist; give a saved dataset folder, a data file "
                           f"({', '.join(FORMATS)}) or a folder of them")
    if not files:
        raise KVBenchError(f"task.dataset={path!r} holds no files")
    return sorted(files)


def _saved(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def load(cfg: Any) -> Any:
    """The configured split as a ``datasets.Dataset``."""
    import datasets

    path = _path(cfg)
    p = Path(path)
    try:
        if _saved(p):
            ds = datasets.load_from_disk(path)
        elif p.is_dir():
            ds = datasets.load_dataset(path)
        else:
            kinds = {FORMATS.get(f.suffix.lower()) for f in data_files(cfg)}
            if None in kinds or len(kinds) != 1:
                raise KVBenchError(f"task.dataset={path!r}: files must share one format of {', '.join(FORMATS)}")
            ds = datasets.load_dataset(kinds.pop(), data_files=[str(f) for f in data_files(cfg)])
    except KVBenchError:
        raise
    except Exception as exc:  # datasets raises many types for unreadable input; one line names the file
        raise KVBenchError(f"cannot read task.dataset={path!r} with datasets ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    if isinstance(ds, datasets.DatasetDict):
        split = cfg.get("split", None)
        names = sorted(ds)
        if split is None:
            split = "test" if "test" in ds else (names[0] if len(names) == 1 else None)
        if split not in ds:
            raise KVBenchError(f"task.split={split!r} is not a split of {path}; valid: {', '.join(names)}")
        ds = ds[split]
    return ds


def dataset_digest(cfg: Any) -> dict[str, Any]:
    """Run-identity entry: sha256 of every file read (relative path -> digest) and the saved fingerprints."""
    files = data_files(cfg)
    root = Path(_path(cfg))
    base = root if root.is_dir() else files[0].parent
    entries = {}
    for f in files:
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda fh=fh: fh.read(1 << 20), b""):
                h.update(block)
        rel = f.relative_to(base).as_posix() if f.is_relative_to(base) else f.name
        entries[rel] = h.hexdigest()
    fingerprints = _fingerprints(root) if _saved(root) else {}
    digest = hashlib.sha256(json.dumps({"files": entries, "fingerprints": fingerprints},
                                       sort_keys=True).encode()).hexdigest()
    return {"kind": "hf", "files": len(entries), "fingerprints": fingerprints, "digest": digest}


def _fingerprints(root: Path) -> dict[str, str]:
    """``_fingerprint`` of each saved split (``state.json``), keyed by split folder."""
    out = {}
    for state in sorted(root.rglob("state.json")):
        try:
            out[state.parent.relative_to(root).as_posix() or "."] = str(json.loads(state.read_text())["_fingerprint"])
        except (OSError, ValueError, KeyError):
            continue
    return out


# ------------------------------------------------------------------------------------------- samples


def _field(cfg: Any, preset: str, role: str, columns: list[str], required: bool) -> str | None:
    given = cfg.get(f"{role}_field", None)
    if given:
        if given not in columns:
            raise KVBenchError(f"task.{role}_field={given!r} is not a column; valid: {', '.join(columns)}")
        return str(given)
    found = next((c for c in FIELDS[preset][role] if c in columns), None)
    if found is None and required:
        raise KVBenchError(f"no {role} column ({' or '.join(FIELDS[preset][role])}) in the dataset; "
                           f"set task.{role}_field to one of: {', '.join(columns)}")
    return found


def _answers(value: Any, i: int) -> list[str]:
    answers = answer_list(value, f"row {i} of the hf task")
    if not answers:
        raise KVBenchError(f"row {i} of the hf task has no answers")
    return answers


def subset_name(cfg: Any, rows: Any = None) -> str | None:
    """The LongBench/InfiniteBench subset: ``task.subset``, else the rows' ``dataset`` column, else the
    file or folder name (``qasper.jsonl`` -> ``qasper``; LongBench's ``_e`` files keep their subset name)."""
    given = cfg.get("subset", None)
    if given:
        return str(given)
    if rows is not None and "dataset" in rows.column_names and len(rows):
        return str(rows[0]["dataset"])
    path = Path(_path(cfg))
    if any(c in path.name for c in "*?["):  # a glob names its folder
        path = path.parent
    return path.name.split(".")[0].removesuffix("_e") or None


def _preset_metric(preset: str, subset: str | None) -> tuple[str | None, int | None]:
    if preset == "longbench":
        if subset in LONGBENCH_ZH:
            raise KVBenchError(f"LongBench subset {subset!r} is scored with jieba word segmentation, which kvbench "
                               "does not ship; set task.metric (e.g. substring) to score it with another metric")
        if subset not in LONGBENCH:
            raise KVBenchError(f"unknown LongBench subset {subset!r} (set task.subset); valid: {', '.join(LONGBENCH)}")
        return LONGBENCH[subset]
    if preset == "infinitebench":
        if subset not in INFINITEBENCH:
            raise KVBenchError(f"InfiniteBench subset {subset!r} has no kvbench metric (set task.subset or "
                               f"task.metric); valid: {', '.join(INFINITEBENCH)}")
        return INFINITEBENCH[subset]
    if preset == "scbench":
        name = subset if subset is None or subset.startswith("scbench_") else f"scbench_{subset}"
        metric, max_new = SCBENCH.get(str(name), (None, 0))
        if metric is None:
            raise KVBenchError(f"SCBench subset {subset!r} has no kvbench metric (set task.subset or task.metric); "
                               f"scored: {', '.join(k for k, v in SCBENCH.items() if v[0])}")
        return metric, max_new
    return None, None


def record_name(cfg: Any, rows: Any = None) -> str:
    """The name records carry as ``task``: ``task.dataset_name``, else ``hf_<subset>`` (:func:`subset_name`:
    ``task.subset``, else the rows' ``dataset`` column, else the file or folder name), so the same rows read
    from a JSON Lines file or a ``save_to_disk`` folder carry one name."""
    given = cfg.get("dataset_name", None)
    if given:
        return str(given)
    return f"hf_{subset_name(cfg, load(cfg) if rows is None else rows) or 'dataset'}"


@register_task("hf", inputs=TaskInputs(digest=lambda cfg: dataset_digest(cfg), located_by=("dataset",)))
def build(cfg: Any, tokenizer: Any, max_context: int) -> list[Sample]:
    """One context per row (the first ``n_samples``, in dataset order); with ``questions_per_context`` > 1,
    rows sharing a context's text are one context (:mod:`kvbench.tasks.shared`)."""
    preset = str(option(cfg, "preset", HF_DEFAULTS))
    if preset not in PRESETS:
        raise KVBenchError(f"unknown task.preset {preset!r}; valid: {', '.join(PRESETS)}")
    rows = load(cfg)
    columns = list(rows.column_names)
    ctx_f = _field(cfg, preset, "context", columns, True)
    t_f = _field(cfg, preset, "turns", columns, preset == "scbench")
    q_f = None if t_f else _field(cfg, preset, "question", columns, False)
    a_f = None if t_f else _field(cfg, preset, "answers", columns, True)
    id_f = _field(cfg, preset, "id", columns, False)
    doc_f = _field(cfg, preset, "document", columns, False)
    m_f = cfg.get("metric_field", None)
    if m_f and m_f not in columns:
        raise KVBenchError(f"task.metric_field={m_f!r} is not a column; valid: {', '.join(columns)}")
    subset = subset_name(cfg, rows) if preset != "none" else None
    given = cfg.get("metric", None)
    try:
        p_metric, p_max_new = _preset_metric(preset, subset)
    except KVBenchError:
        if not given:  # a subset the preset cannot score is fine once the user names a metric
            raise
        p_metric, p_max_new = None, None
    metric = str(given or p_metric or "substring")
    max_new = int(cfg.get("max_new_tokens", None) or p_max_new or 32)
    k, query_aware, mode = sharing(cfg, t_f is not None)
    n = int(option(cfg, "n_samples", HF_DEFAULTS))
    name = record_name(cfg, rows)
    source = Path(_path(cfg)).name
    base = {"task": name, "variant": "qa", "seed": int(option(cfg, "seed", HF_DEFAULTS)), "preset": preset,
            "subset": subset, "depth": None, "needle_token_index": None, "distractors": 0}

    def row_key(i: int, row: dict[str, Any]) -> Any:
        row_id = row[id_f] if id_f else None
        return row_id if row_id not in (None, "") else f"{i:04d}"

    def row_metric(i: int, row: dict[str, Any]) -> str:
        value = str(row[m_f]) if m_f else metric
        if value not in TEXT_METRICS:
            raise KVBenchError(f"row {i}: metric {value!r} is not valid; valid: {', '.join(TEXT_METRICS)}")
        return value

    def context_of(i: int, row: dict[str, Any]) -> str:
        if not isinstance(row[ctx_f], str):
            raise KVBenchError(f"row {i}: column {ctx_f!r} is not text")
        return row[ctx_f]

    contexts = []
    if t_f:  # one row, one context, several turns
        for i, row in enumerate(rows.select(range(min(n, len(rows))))):
            key = row_key(i, row)
            turns = _turns(row[t_f], i, k)
            questions = []
            for j, turn in enumerate(turns):
                t_metric, t_max = _turn_metric(turn, preset, given, metric, max_new, m_f, i)
                questions.append(Question(
                    sample_id=f"{name}/{key}/q{j}", text=_turn_text(turn), answers=_answers(turn.get("answer"), i),
                    metric=row_metric(i, row) if m_f else t_metric, max_new_tokens=t_max,
                    metadata={**base, "index": i, "source_docs": [f"{source}:{key}"]}))
            contexts.append(Context(context_of(i, row), questions, context_id=f"{name}/{key}",
                                    metadata=document_meta(row, doc_f)))
    else:
        if (k or 1) > 1:
            texts = [r if isinstance(r, str) else "" for r in rows[ctx_f]]
            groups = group_by_text(texts, int(k or 1), n)
        else:
            groups = [[i] for i in range(min(n, len(rows)))]
        for group in groups:
            questions = []
            for i in group:
                row = rows[i]
                key = row_key(i, row)
                questions.append(Question(
                    sample_id=f"{name}/{key}", text="" if q_f is None or row[q_f] is None else str(row[q_f]),
                    answers=_answers(row[a_f], i), metric=row_metric(i, row), max_new_tokens=max_new,
                    metadata={**base, "index": i, "source_docs": [f"{source}:{key}"]}))
            first = rows[group[0]]
            shared_id = f"{name}/context/{row_key(group[0], first)}" if (k or 1) > 1 else None
            contexts.append(Context(context_of(group[0], first), questions, context_id=shared_id,
                                    metadata=document_meta(first, doc_f)))
    samples = qa_samples(contexts, tokenizer, context_tokens=int(option(cfg, "context_tokens", HF_DEFAULTS)),
                         query_aware=query_aware, instruction=str(option(cfg, "instruction", HF_DEFAULTS)),
                         answer_prefix=str(option(cfg, "answer_prefix", HF_DEFAULTS)), mode=mode)
    if not samples:
        raise KVBenchError(f"task.dataset={_path(cfg)!r} holds no rows")
    dupes = sorted(sid for sid, c in Counter(s.sample_id for s in samples).items() if c > 1)
    if dupes:
        raise KVBenchError(f"duplicate ids in {_path(cfg)}: {', '.join(dupes[:10])}; give every row a unique id "
                           "(task.id_field) or set task.id_field to a unique column")
    return samples


def _turns(value: Any, i: int, k: int | None) -> list[dict[str, Any]]:
    """A row's ``multi_turns`` (a list of ``{input, answer, ...}``), its first ``k`` when given."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = None
    if not isinstance(value, list) or not value or not all(isinstance(t, dict) and "input" in t for t in value):
        raise KVBenchError(f"row {i}: multi_turns must be a non-empty list of {{input, answer}} objects")
    return value[:k] if k else value


def _turn_text(turn: dict[str, Any]) -> str:
    """The turn's question; a multiple-choice turn lists its options as SCBench's prompt does."""
    text = str(turn["input"] or "")
    options = turn.get("options") or []
    if options:
        text += "".join(f"\n{letter}. {o}" for letter, o in zip("ABCDEFGH", options, strict=False))
    return text


def _turn_metric(turn: dict[str, Any], preset: str, given: Any, metric: str, max_new: int, m_f: Any,
                 i: int) -> tuple[str, int]:
    """A turn's metric and answer length: SCBench's multi-task subsets name each turn's ``task``."""
    sub = turn.get("task")
    if preset != "scbench" or not sub or given or m_f:
        return metric, max_new
    if sub not in SCBENCH or SCBENCH[sub][0] is None:
        raise KVBenchError(f"row {i}: SCBench turn task {sub!r} has no kvbench metric; set task.metric "
                           f"(scored: {', '.join(k for k, v in SCBENCH.items() if v[0])})")
    return SCBENCH[sub][0], SCBENCH[sub][1]
