"""Integrity, fourth pass (issue 53): what kvbench keeps in its cache — the machine's seal key.

``seal.key`` replaced by a FIFO hung every run on its first read. The key is opened without blocking and used
only when it is a regular file; otherwise nothing is trusted from a cache (baselines and digests recomputed), one
line says so, and the run finishes. (The kernel cache's lock and built library are issue 53's other half.)"""

from __future__ import annotations

import os
import threading

import pytest
import test_integrity as ti

from kvbench.results import local_seal, seal_matches
from kvbench.results import seal as seal_mod

pytestmark = pytest.mark.usefixtures("single_torch_thread")
kvbench, _base, _run_dir = ti.kvbench, ti._base, ti._run_dir
qa = ti.qa


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(seal_mod, "_NOTED", set())
    (tmp_path / "cache").mkdir()
    return tmp_path / "cache"


def _within(seconds: float, fn):
    """``fn()`` run in a thread; fails the test instead of hanging it when it does not return in time."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "hung"
    return out[0]


def test_a_fifo_seal_key_is_no_key_in_one_line(cache, capsys):
    os.mkfifo(cache / "seal.key")
    assert _within(10, lambda: local_seal(b"x")) is None  # today: blocks for ever on open
    assert _within(10, lambda: seal_matches("0" * 64, b"x")) is False
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "seal.key is not a regular file" in err[0], err


def test_a_directory_in_place_of_the_seal_key_is_no_key(cache, capsys):
    (cache / "seal.key").mkdir()
    assert local_seal(b"x") is None
    assert "is not a regular file" in capsys.readouterr().err


def test_a_regular_key_is_made_once_and_used(cache):
    first = local_seal(b"x")
    assert first is not None and local_seal(b"x") == first and seal_matches(first, b"x")
    assert len((cache / "seal.key").read_bytes()) == 32


def test_a_run_with_a_fifo_seal_key_finishes_with_one_line(capsys, tmp_path, qa, cache):
    os.mkfifo(cache / "seal.key")
    code, err, out = _within(300, lambda: kvbench(capsys, *_base(tmp_path / "results", qa)))
    assert code == 0, err
    assert len(err) == 1 and "seal.key is not a regular file" in err[0], err
    assert (_run_dir(out) / "records.jsonl").is_file()
