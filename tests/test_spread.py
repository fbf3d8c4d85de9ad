

def test_documents_used_counts_primary_documents_per_task(tmp_path):
    import json

    import pandas as pd

    from kvbench.tasks import corpora

    meta = [{"document_id": "a#01"}, {"source_docs": ["b", "c"]}, {"source_docs": ["b"]}, {}]
    rows = [{"task": "fiction", "sample_id": f"s{i}", "strategy": st, "config_hash": "h", "sample_meta": json.dumps(m)}
            for i, m in enumerate(meta) for st in ("full", "snapkv")]
    rows.append({"task": "papers", "sample_id": "p0", "strategy": "full", "config_hash": "h", "sample_meta": "{}",
                 "document_id": "pmc:x"})
    (tmp_path / "store").mkdir()
    pd.DataFrame(rows).to_parquet(tmp_path / "store" / "x.parquet")
    # a#01, b (twice), and the sample id s3 for a record without any document field
    assert corpora.documents_used(tmp_path) == {"fiction": {"samples": 4, "documents": 3},
                                                "papers": {"samples": 1, "documents": 1}}
    assert corpora.main(["--results", str(tmp_path / "missing")]) == 2
