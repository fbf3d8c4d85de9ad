"""Experiment tracking: every kvbench run logged to MLflow (``python -m kvbench tracking=mlflow ...``).

``conf/tracking/mlflow.yaml`` registers :class:`MLflowCallback` as a Hydra callback (``hydra.callbacks.mlflow``);
when a job has finished it logs the run it wrote, from the run directory's own files:

* one MLflow run per kvbench run, named by its run id and found again by the tag ``kvbench.run_id`` (a resumed
  or repeated kvbench run logs into the same MLflow run, in experiment ``tracking.experiment``);
* its identity (``identity.json``: task, model, hardware, seed, digests, strategies) as parameters, and the run
  id, config hash, task, model and run directory as tags;
* per-strategy figures of ``summary.csv`` (each numeric column of :data:`kvbench.record.METRICS`) as metrics
  named ``<strategy>/<figure>`` by the short label the tables show (:func:`kvbench.labels.shorten`: ``int8``, not
  ``int8(axis=token,group_size=64)``; characters MLflow refuses become ``_``), each short label's full label a
  parameter ``strategy.<short label>``;
* the run directory (config, identity, environment, records, summary) as artifacts under ``run/``, without the
  files a run keeps only while it runs (its ``.lock``, the ``.claims/`` of concurrent workers: names with a
  leading dot).

``tracking.uri`` null uses ``$MLFLOW_TRACKING_URI`` when set, else a local file store,
``<results_dir>/mlruns``; any MLflow tracking URI works (``http://host:5000``, ``sqlite:///mlflow.db``). MLflow 3
keeps the file store in maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE=true``, which kvbench sets for file
URIs it writes; set it too when reading that store (``mlflow.search_runs``). Results are written before anything
is logged, so a tracking error is one warning and never touches them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any

from kvbench.errors import KVBenchError

#: MLflow's limit on a parameter value (characters); longer values stay in the identity.json artifact.
MAX_PARAM_CHARS = 6000
TAG = "kvbench.run_id"


def check_available() -> None:
    """``tracking=mlflow`` needs MLflow installed: one line naming the install, before anything runs."""
    if importlib.util.find_spec("mlflow") is None:
        raise KVBenchError("tracking=mlflow needs MLflow: pip install 'kvbench[tracking]' (mlflow-skinny), "
                           "or choose tracking=none")


def tracking_uri(uri: str | None, results_dir: str | Path) -> str:
    """The URI runs are logged to: the one given, else ``$MLFLOW_TRACKING_URI``, else a local file store."""
    if uri:
        return str(uri)
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return (Path(results_dir).expanduser().resolve() / "mlruns").as_uri()


def metric_key(*parts: str) -> str:
    """An MLflow metric name from ``parts`` (MLflow allows letters, digits, ``_-. :/``)."""
    return "/".join(re.sub(r"[^\w\-. :]", "_", p).strip("_") for p in parts)


def _params(identity: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The identity flattened (``task_config.context_tokens``); lists as JSON; values MLflow cannot hold left out."""
    out: dict[str, str] = {}
    for key, value in identity.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_params(value, f"{name}."))
            continue
        text = json.dumps(value, sort_keys=True) if isinstance(value, list) else str(value)
        if len(text) <= MAX_PARAM_CHARS:
            out[name] = text
    return out


def _metrics(run_dir: Path) -> dict[str, float]:
    import pandas as pd

    from kvbench.labels import shorten
    from kvbench.record import METRICS

    path = run_dir / "summary.csv"
    if not path.is_file():
        return {}
    summary = pd.read_csv(path)
    several = summary[["task", "setting"]].drop_duplicates().shape[0] > 1 if {"task", "setting"} <= set(summary) \
        else False
    out = {}
    for _, row in summary.iterrows():
        where = (str(row["task"]), str(row["setting"])) if several else ()
        for name in METRICS:
            value = row.get(name)
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                out[metric_key(*where, shorten(str(row["strategy"])), name)] = float(value)
    return out


def _labels(run_dir: Path) -> dict[str, str]:
    """``strategy.<short label>`` -> the full label, for each strategy of ``summary.csv``."""
    import pandas as pd

    from kvbench.labels import shorten

    path = run_dir / "summary.csv"
    if not path.is_file():
        return {}
    return {f"strategy.{metric_key(shorten(s))}": s for s in pd.read_csv(path)["strategy"].astype(str).unique()}


def _artifacts(run_dir: Path) -> list[Path]:
    """The run directory's files to keep: none under a name with a leading dot (the run's lock, the claims of
    concurrent workers — transient files that say nothing once the run is done)."""
    return sorted(f for f in run_dir.rglob("*")
                  if f.is_file() and not any(part.startswith(".") for part in f.relative_to(run_dir).parts))


def log_run(run_dir: str | Path, uri: str | None = None, experiment: str = "kvbench",
            artifacts: bool = True) -> str:
    """Log the kvbench run in ``run_dir`` to MLflow (into the MLflow run tagged with its run id, if one exists);
    returns the MLflow run id."""
    check_available()
    run_dir = Path(run_dir).resolve()
    results_dir = run_dir.parent.parent  # <results_dir>/runs/<run id>
    uri = tracking_uri(uri, results_dir)
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3: the file store is opt-in
    import mlflow

    identity = json.loads((run_dir / "identity.json").read_text()) if (run_dir / "identity.json").is_file() else {}
    run_id = run_dir.name
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
    found = client.search_runs([exp_id], filter_string=f"tags.`{TAG}` = '{run_id}'", max_results=1)
    tags = {TAG: run_id, "kvbench.config_hash": str(identity.get("config_hash", "")),
            "kvbench.task": str(identity.get("task", "")), "kvbench.model": str(identity.get("model", "")),
            "kvbench.run_dir": str(run_dir), "kvbench.spec": str(identity.get("spec", ""))}
    if found:
        mlflow_run = found[0].info.run_id
        client.update_run(mlflow_run, status="RUNNING")
    else:
        mlflow_run = client.create_run(exp_id, run_name=run_id, tags=tags).info.run_id
    try:
        from mlflow.entities import Metric, Param, RunTag

        params = _params({k: v for k, v in identity.items() if k != "strategies"})
        params["strategies"] = json.dumps([s[0] for s in identity.get("strategies", [])])
        params.update(_labels(run_dir))
        logged = found[0].data.params if found else {}
        # A parameter is written once in MLflow; a resumed run's identity is the same by construction.
        new = [Param(k, v) for k, v in params.items() if k not in logged]
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, 0) for k, v in _metrics(run_dir).items()]
        for i in range(0, max(len(new), len(metrics), 1), 100):  # MLflow takes at most 100 params per batch
            client.log_batch(mlflow_run, metrics=metrics[i:i + 100], params=new[i:i + 100],
                             tags=[RunTag(k, v) for k, v in tags.items()] if i == 0 else [])
        if artifacts:
            for f in _artifacts(run_dir):
                where = f.relative_to(run_dir).parent
                client.log_artifact(mlflow_run, str(f), artifact_path="/".join(("run", *where.parts)))
        client.set_terminated(mlflow_run, status="FINISHED")
    except Exception:
        client.set_terminated(mlflow_run, status="FAILED")
        raise
    return mlflow_run


try:  # Hydra is a dependency; the callback base class only moved once (hydra 1.1 -> experimental)
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover
    Callback = object  # type: ignore[assignment,misc]


class MLflowCallback(Callback):  # type: ignore[misc]
    """Hydra callback: log each finished job's kvbench run to MLflow (settings: the job's ``tracking`` node)."""

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        from kvbench.results import warn

        if job_return.status != JobStatus.COMPLETED:
            return
        run_dir = getattr(job_return.return_value, "attrs", {}).get("run_dir")  # kvbench.cli's job returns it
        if not run_dir:
            return
        settings = config.get("tracking") or {}
        try:
            mlflow_run = log_run(run_dir, settings.get("uri"), str(settings.get("experiment") or "kvbench"),
                                 bool(settings.get("artifacts", True)))
        except Exception as exc:  # noqa: BLE001 (results are already written; tracking must not fail the run)
            warn(f"tracking: the run was not logged to MLflow ({type(exc).__name__}: "
                 f"{str(exc).splitlines()[0] if str(exc) else ''})")
            return
        print(f"mlflow: run {mlflow_run} at {tracking_uri(settings.get('uri'), config.results_dir)}")
