"""kvbench's Hydra configuration, with one source of truth for every default, type and check.

* A strategy's parameters, defaults and types are its dataclass fields (``strategies/<name>.py``); its values
  are checked by its ``validate()``. They are registered in Hydra's ConfigStore as the typed node
  ``schema/strategy/<name>``; ``conf/strategy/<name>.yaml`` only pulls that node in (and documents it).
  A strategy from another package (entry point ``kvbench.strategies``) has no YAML and is registered as
  ``strategy/<name>`` directly.
* A task's settings are its module's ``<NAME>_DEFAULTS`` dict (``kvbench/tasks/<name>.py``), registered as
  ``schema/task/<name>``, typed from the default values; ``conf/task/<name>.yaml`` adds only required keys
  (``???``) and comments.
* Top-level keys (``seed``, ``results_dir``, ``engine.*``, ``strategies``, ``strategies_params``) are
  :class:`KVBenchConfig` below, registered as ``kvbench_schema``.

Every override is parsed by Hydra (sweeps, ``choice``, ``range``, ``glob`` included); :func:`check_overrides`
composes each job before anything runs and turns Hydra's multi-line errors into one :class:`KVBenchError` line.

Why one module of this length: the schema, the registry-generated defaults, Hydra composition and the job
checks all run inside one Hydra context and share the group and schema names registered here; the sections
(schemas, defaults, composition, checks, strategies) read in that order.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import math
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union  # noqa: UP035  (OmegaConf reads these typing forms)

from kvbench.errors import KVBenchError
from kvbench.paths import conf_dir

GROUPS = ("strategy", "task", "model", "hardware", "tracking")


@dataclass
class EngineConfig:
    prefill: str = "shared"       # shared: one exact prefill per sample shared by all strategies; chunked: lower peak
    chunk_tokens: int = 512       # chunk size for engine.prefill=chunked
    # Samples evaluated together (records equal batch 1's; latency/peak are the batch's). 1 by measurement:
    # batch 4 gave 0.98x batch 1's throughput at 4K on 2 CPU cores, where the prefill is compute-bound
    # (results/perf/harness.md), and batch 1 keeps each record's latency and peak its own sample's.
    batch_size: int = 1
    max_new_samples: int = 0      # stop after this many not-yet-done samples (0: all); not part of the run's identity
    working_copy: bool = True     # quantized stores keep a dequantized copy of their prefix (reported as scratch_bytes)
    attention: str = "auto"       # auto | sdpa | kvbench: attention for decode/short queries (kvbench/attention.py)
    linear: str = "auto"          # auto | native | float32 | upcast: 16-bit linears in float32 (kvbench/linear.py)
    reader: str = "auto"          # auto | simd | fused | blocks: what reads a stored cache (kvbench/fused.py READERS)
    warmup: bool = True           # one short forward before timing anything
    reuse_baseline: bool = True   # reuse stored `full` results keyed by everything that determines them
    progress: bool = True


@dataclass
class KVBenchConfig:
    """The top-level keys; the groups (model, task, strategy, hardware) are filled in by the defaults list."""

    model: Any = None
    task: Any = None
    strategy: Any = None
    hardware: Any = None
    tracking: Any = None  # tracking=none | mlflow (conf/tracking/, kvbench/tracking.py)
    # Several strategies sharing each prefill, e.g. strategies=[int8,snapkv]; replaces `strategy`. `full` is
    # always added and runs first.
    strategies: Optional[List[str]] = None  # noqa: UP006, UP045
    # Overrides for `strategies`: strategies_params.compression_ratio=0.75 (every listed strategy that has the
    # parameter) or strategies_params.snapkv.window_size=16 (one listed strategy).
    strategies_params: Dict[str, Any] = field(default_factory=dict)  # noqa: UP006
    seed: int = 0
    # Run directories and the parquet store go here. Ad-hoc runs default to results/adhoc (git-ignored), so they
    # never enter the committed leaderboard (results/store): the sweeps that publish it name results_dir.
    results_dir: str = "results/adhoc"
    engine: EngineConfig = field(default_factory=EngineConfig)


def group_options(group: str) -> list[str]:
    """Selectable names of a config group (strategies include those registered by other packages)."""
    if group == "strategy":
        from kvbench import strategies

        return strategies.available()
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


# -- schemas generated from the dataclasses ----------------------------------------------------------------
_SIMPLE = (int, float, bool, str)


def _config_type(hint: Any) -> Any:
    """An annotation as a type OmegaConf can check (``Any`` for what it cannot)."""
    origin = typing.get_origin(hint)
    if hint in _SIMPLE:
        return hint
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and args[0] in _SIMPLE and len(typing.get_args(hint)) == 2:
            return Optional[args[0]]  # noqa: UP045
        return Any
    if origin is typing.Literal:
        kinds = {type(a) for a in typing.get_args(hint)}
        return kinds.pop() if len(kinds) == 1 and next(iter(kinds)) in _SIMPLE else Any
    if hint is dict or origin is dict:
        return Dict[str, Any]  # noqa: UP006
    if hint is list or origin in (list, tuple):
        return List[Any]  # noqa: UP006
    return Any


def _value_type(value: Any) -> Any:
    if isinstance(value, bool):
        return bool
    if isinstance(value, (int, float, str)):
        return type(value)
    if isinstance(value, dict):
        return Dict[str, Any]  # noqa: UP006
    if isinstance(value, (list, tuple)):
        kinds = {type(v) for v in value}
        return List[kinds.pop()] if len(kinds) == 1 and next(iter(kinds)) in _SIMPLE else List[Any]  # noqa: UP006
    return Any


def _node(title: str, fields: list[tuple[str, Any, Any]]) -> Any:
    """A typed OmegaConf node of ``(name, type, default)``; dict fields stay open to new keys (no ``+``)."""
    from omegaconf import OmegaConf

    specs = []
    for name, kind, default in fields:
        if isinstance(default, (dict, list)):
            specs.append((name, kind, field(default_factory=lambda d=default: _copy(d))))
        else:
            specs.append((name, kind, default))
    try:
        node = OmegaConf.structured(dataclasses.make_dataclass(title, specs))
    except Exception:  # a type OmegaConf refuses: keep the defaults, drop the types
        node = OmegaConf.create({name: default for name, _, default in fields})
    for name, kind, _ in fields:
        if kind == Dict[str, Any]:  # noqa: UP006
            OmegaConf.set_struct(node[name], False)
    return node


def _copy(value: Any) -> Any:
    import copy

    return copy.deepcopy(value)


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "???"  # a required parameter: Hydra reports it missing


def strategy_defaults(name: str) -> dict[str, Any]:
    """``{"name": name, <parameter>: <default>, ...}`` from the strategy's dataclass fields."""
    from kvbench import strategies

    cls = strategies.strategy_class(name)
    return {"name": name, **{f.name: _field_default(f) for f in dataclasses.fields(cls)}}  # type: ignore[arg-type]


def strategy_node(name: str) -> Any:
    """The typed config node of strategy ``name``, generated from its dataclass."""
    from kvbench import strategies

    cls = strategies.strategy_class(name)
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation that does not resolve: fall back to untyped
        hints = {}
    fields = [("name", str, name)] + [(f.name, _config_type(hints.get(f.name, Any)), _field_default(f))
                                      for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    return _node(f"{cls.__name__}Config", fields)


def strategy_params(name: str, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The parameters ``strategy=name`` runs with: the dataclass defaults with ``overrides`` merged in deeply
    (``{"evict_params": {"budget_tokens": 64}}`` keeps compose's other defaults) and type-checked.
    The one loader used by the CLI's ``strategies=[...]``, lm-eval and Python callers."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    node = strategy_node(name)
    params = dict(overrides or {})
    valid = [k for k in node if k != "name"]
    unknown = [k for k in params if k not in valid and k != "name"]
    if unknown:
        raise KVBenchError(_no_parameter(name, unknown[0], valid))
    try:
        merged = OmegaConf.to_container(OmegaConf.merge(node, params), resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
        where = f"{name}.{key}={params.get(str(key).split('.')[0])!r}" if key else name
        raise KVBenchError(f"strategy parameter {where}: {_value_error(exc)}") from None
    merged.pop("name", None)  # type: ignore[union-attr]
    return merged  # type: ignore[return-value]


def _no_parameter(strategy: str, param: str, valid: list[str]) -> str:
    near = difflib.get_close_matches(param, valid, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return f"strategy {strategy!r} has no parameter {param!r}; valid: {', '.join(valid) or '(none)'}{hint}"


def task_defaults(name: str) -> dict[str, Any] | None:
    """The task module's ``<NAME>_DEFAULTS`` (``kvbench/tasks/<name>.py``), or None when it has none."""
    try:
        module = importlib.import_module(f"kvbench.tasks.{name}")
    except ImportError:
        return None
    defaults = getattr(module, f"{name.upper()}_DEFAULTS", None)
    return dict(defaults) if isinstance(defaults, dict) else None


def task_node(name: str, defaults: dict[str, Any]) -> Any:
    """The typed task node: one field per default (typed from its value); ``seed`` follows the top-level seed.
    Settings without a default (``path: ???`` in ``conf/task/<name>.yaml``) are required strings."""
    import yaml

    fields = [("name", str, name)]
    path = conf_dir() / "task" / f"{name}.yaml"
    listed = (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
    fields += [(k, str, "???") for k, v in listed.items() if v == "???" and k not in defaults]
    for key, value in defaults.items():
        if key == "seed":
            fields.append((key, int, "${seed}"))
        elif key == "context_tokens" and isinstance(value, int):
            # The task's length, fitted to the chosen model's window (see fit_context): `model=tiny-llama`
            # works with every task's defaults, and `--cfg job` shows the number used.
            fields.append((key, int, f"${{kvbench_context:{value},${{model.name}},${{oc.select:model.path,null}}}}"))
        else:
            fields.append((key, _value_type(value), value))
    return _node(f"{name.title()}TaskConfig", fields)


# -- defaults that depend on the model -------------------------------------------------------------------
#: Tokens kept free of the document in a fitted default: the prompt, question and answer of every shipped
#: task fit in it (legal at 2,048 tokens needs 76 more than its context; the rest are shorter).
CONTEXT_HEADROOM = 256


@functools.lru_cache(maxsize=32)
def model_max_context(name: str, path: str | None = None) -> int | None:
    """The positions a model takes (``max_position_embeddings``) without loading its weights: the built-in
    tiny Llama's, a :mod:`kvbench.calc` preset's, or a local checkpoint's ``config.json``; None if unknown."""
    if name == "tiny-llama":
        from kvbench.models import tiny_llama

        return int(tiny_llama().config.max_position_embeddings)
    from kvbench import calc

    try:
        arch = calc.resolve_model(str(path) if path else name)
    except KVBenchError:
        return None
    return int(arch.max_position_embeddings) if arch.max_position_embeddings else None


def fit_context(default: int, model: str, path: str | None = None) -> int:
    """A task's default length when it fits the model with :data:`CONTEXT_HEADROOM` to spare; otherwise the
    largest power of two that does (tiny-llama's 2,048 positions: 1,024). An explicit
    ``task.context_tokens=...`` replaces this and is checked against the model as given."""
    limit = model_max_context(str(model), str(path) if path else None)
    if not limit or default + CONTEXT_HEADROOM <= limit:
        return int(default)
    return 2 ** int(math.log2(max(limit - CONTEXT_HEADROOM, 1)))


_REGISTERED: set[str] = set()


def register_configs() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent; new strategies/tasks are added on later calls).
    Must run before Hydra composes kvbench's config, in every process that composes it."""
    from hydra.core.config_store import ConfigStore

    from kvbench import strategies
    from kvbench.tasks.base import task_names

    cs = ConfigStore.instance()
    if "kvbench_schema" not in _REGISTERED:
        from omegaconf import OmegaConf

        if not OmegaConf.has_resolver("kvbench_context"):
            OmegaConf.register_new_resolver("kvbench_context", fit_context)

        top = OmegaConf.structured(KVBenchConfig)
        OmegaConf.set_struct(top.strategies_params, False)  # strategies_params.<anything>=... needs no `+`
        cs.store(name="kvbench_schema", node=top)
        _REGISTERED.add("kvbench_schema")
    yaml_dir = conf_dir()
    current = set(strategies.available())
    for key in [k for k in _REGISTERED if k.startswith("strategy/") and k.split("/", 1)[1] not in current]:
        _forget(cs, key.split("/", 1)[1])  # a plugin no longer on sys.path
        _REGISTERED.discard(key)
    for name in sorted(current):
        key = f"strategy/{name}"
        if key in _REGISTERED:
            continue
        node = strategy_node(name)
        cs.store(group="schema/strategy", name=name, node=node)
        if not (yaml_dir / "strategy" / f"{name}.yaml").is_file():
            cs.store(group="strategy", name=name, node=node)  # a plugin strategy: no YAML needed
        _REGISTERED.add(key)
    for name in task_names():
        key = f"task/{name}"
        defaults = task_defaults(name)
        if key in _REGISTERED or defaults is None:
            continue
        cs.store(group="schema/task", name=name, node=task_node(name, defaults))
        _REGISTERED.add(key)


def _forget(cs: Any, name: str) -> None:
    for group in (("strategy",), ("schema", "strategy")):
        node = cs.repo
        for part in group:
            node = node.get(part, {})
        node.pop(f"{name}.yaml", None)


# -- composing and checking overrides ----------------------------------------------------------------------
@contextmanager
def hydra_context() -> Iterator[Any]:
    """Hydra initialised on kvbench's config tree (cleared afterwards); yields a config loader."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            yield GlobalHydra.instance().config_loader()
    finally:
        GlobalHydra.instance().clear()


def compose_config(overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """The job config ``python -m kvbench <overrides>`` runs (no ``hydra.*`` node); errors are one line."""
    from hydra import compose

    with hydra_context():
        return _compose(compose, list(overrides))


def _compose(compose: Any, overrides: list[str]) -> Any:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise KVBenchError(explain(exc, overrides)) from None


def parse_jobs(overrides: list[str], multirun: bool, loader: Any = None) -> list[list[str]]:
    """The jobs Hydra runs for ``overrides`` (one override list each), parsed and expanded by Hydra itself:
    ``a,b``, ``choice()``, ``range()``, ``glob()`` (against the group's options). ``hydra.*`` overrides are
    left out. Without ``multirun`` a sweep is an error, as in Hydra, but one line long."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create(config_loader=loader).parse_overrides(list(overrides))
    except HydraException as exc:
        raise KVBenchError(f"cannot parse override: {_first_line(exc)}") from None
    parsed = [o for o in parsed if not o.is_hydra_override()]
    for o in parsed:
        if o.key_or_group == "results_dir" and o.is_sweep_override():
            raise KVBenchError(f"{o.input_line}: results_dir is one directory, never a sweep; quote a name that "
                               f"holds a comma (results_dir='{o.input_line.split('=', 1)[1]}')")
    sweeps = [o.input_line for o in parsed if o.is_sweep_override()]
    if sweeps and not multirun:
        raise KVBenchError(f"{sweeps[0]} is a sweep: add -m to run one job per value (python -m kvbench -m "
                           f"{sweeps[0]}), or write a list as key=[a,b]")
    for o in parsed:
        if o.is_sweep_override() and "glob" in o.input_line and loader is not None and not list(o.sweep_iterator()):
            valid = ", ".join(group_options(o.key_or_group)) if o.key_or_group in GROUPS else "(none)"
            raise KVBenchError(f"{o.input_line} matches no {o.key_or_group}; valid: {valid}")
    if not multirun:  # one job, its overrides applied in order as given (a later one may fail on an earlier)
        return [[o.input_line for o in parsed]]
    try:
        return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except HydraException as exc:
        msg = _first_line(exc)
        if "INTERVAL" in msg:
            msg = "interval() needs a sampling sweeper (Optuna, Ax, Nevergrad); kvbench's basic sweeper takes " \
                  "a,b,c, choice(...), range(...) and glob(...)"
        raise KVBenchError(msg) from None


class JobError(KVBenchError):
    """A job's overrides do not compose; ``job`` names it."""

    def __init__(self, message: str, job: list[str]) -> None:
        super().__init__(message)
        self.job = job


def compose_jobs(jobs: list[list[str]]) -> Iterator[tuple[list[str], Any]]:
    """``(job, config)`` for each job, inside :func:`hydra_context`. Jobs sharing their group choices
    (``strategy=``, ``task=``, ...) share one composition, and their other overrides are applied to a copy by
    Hydra's own override logic: a 324-job grid composes in seconds, not minutes."""
    import copy

    from hydra import compose
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    parser = OverridesParser.create()
    bases: dict[tuple[str, ...], Any] = {}
    for job in jobs:
        parsed = parser.parse_overrides(job)
        choices = tuple(o.input_line for o in parsed if o.key_or_group in GROUPS)
        try:
            _refuse_deletions([o for o in parsed if o.key_or_group in GROUPS], None)
            if choices not in bases:
                bases[choices] = _compose(compose, list(choices))
            _refuse_new_keys(parsed, bases[choices], job)
            _refuse_deletions(parsed, bases[choices])
            cfg = copy.deepcopy(bases[choices])
            ConfigLoaderImpl._apply_overrides_to_config([o for o in parsed if o.key_or_group not in GROUPS], cfg)
        except (HydraException, OmegaConfBaseException) as exc:
            raise JobError(explain(exc, job), job) from None
        except KVBenchError as exc:
            raise JobError(str(exc), job) from None
        yield job, cfg


def _refuse_new_keys(parsed: list[Any], cfg: Any, job: list[str]) -> None:
    """``+key=value`` adds a key the config does not have, which nothing reads (``+resutls_dir=x`` would be
    ignored): refused like a misspelled key. Open nodes (``strategies_params``) take new keys without ``+``."""
    from omegaconf import DictConfig, OmegaConf

    for o in parsed:
        if not (o.is_add() or o.is_force_add()) or o.key_or_group in GROUPS:
            continue
        key = o.key_or_group
        parent_key = key.rpartition(".")[0]
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        if OmegaConf.select(cfg, key, default=_ABSENT) is not _ABSENT:
            continue  # ++key=value of a key that exists: a plain override
        if isinstance(parent, DictConfig) and OmegaConf.is_struct(parent) is False:
            continue
        raise KVBenchError(_unknown_key(key, [x for x in job if x != o.input_line]))


def _refuse_deletions(parsed: list[Any], cfg: Any) -> None:
    """``~key`` deletes a key every job reads (``~seed`` left ``task.seed`` pointing at nothing; ``~results_dir``
    left no place to write; ``~strategy`` no strategy): refused in one line saying what to set instead. Keys of
    open nodes (``strategies_params``) may be deleted."""
    from omegaconf import DictConfig, OmegaConf

    from kvbench.results import printable

    for o in parsed:
        if not o.is_delete():
            continue
        key = o.key_or_group
        if key in GROUPS:
            raise KVBenchError(f"{printable(o.input_line)}: every job needs a {key}; choose one instead, {key}=<name> "
                               f"(valid: {', '.join(group_options(key))})")
        parent_key = key.rpartition(".")[0]
        parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
        if isinstance(parent, DictConfig) and OmegaConf.is_struct(parent) is False:
            continue
        current = OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=False)
        hint = f" (default {key}={current})" if current is not _ABSENT and not OmegaConf.is_config(current) else ""
        raise KVBenchError(f"{printable(o.input_line)}: {printable(key)} cannot be deleted, every job reads it; set "
                           f"it instead, {printable(key)}=<value>{hint}")


_ABSENT = object()

#: Strategies built while :func:`check_overrides` checked a job, keyed by the job's resolved config: the job,
#: run in this process, takes them (:func:`validate_cfg`) instead of building them again.
_CHECKED: dict[str, list[Any]] = {}


def _job_key(cfg: Any) -> str:
    from omegaconf import OmegaConf

    from kvbench.results import stable_hash

    return stable_hash(OmegaConf.to_container(cfg, resolve=True), 64)


def check_overrides(overrides: list[str], multirun: bool | None = None, samples: bool = True) -> int:
    """Compose and validate every job of ``overrides`` before anything runs (nothing is written).

    Returns the number of jobs. ``multirun=None`` accepts sweeps (a sweep file's job list). ``samples=False``
    leaves out :func:`check_task_fits`, the one check that reads the task's data (a dataset download, a corpus
    tokenized): printing the config (``--cfg job``) needs the composition, not the documents."""
    with hydra_context() as loader:
        jobs = parse_jobs(list(overrides), True if multirun is None else multirun, loader)
        unique = list({tuple(j): j for j in jobs}.values())
        for job, cfg in compose_jobs(unique):
            try:
                _CHECKED[_job_key(cfg)] = check_job(cfg, job)
                if samples:
                    check_task_fits(cfg)
            except KVBenchError as exc:
                raise JobError(str(exc), job) from None
    return len(jobs)


@functools.lru_cache(maxsize=8)
def _tokenizer(name: str, path: str | None) -> tuple[Any, int]:
    """(tokenizer, max context) of a model, without its weights. Raises KVBenchError when unavailable."""
    if name == "tiny-llama":
        from kvbench.models import ByteTokenizer

        return ByteTokenizer(), int(model_max_context(name) or 0)
    from kvbench.models import _checkpoint_dir, converted_smollm2_dir

    source: Any = converted_smollm2_dir() if name == "smollm2-135m" else (_checkpoint_dir(name, path) or name)
    try:
        from transformers import AutoConfig, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source)
        limit = int(getattr(AutoConfig.from_pretrained(source), "max_position_embeddings", 0) or 0)
    except Exception as exc:  # noqa: BLE001 (any loader error: the run reports it as one line)
        raise KVBenchError(f"cannot load the tokenizer of {name!r}: {_first_line(exc)}") from None
    return tokenizer, limit


_FITTED: dict[str, str] = {}  # task config (JSON) + model -> "" when it fits, else the error


def check_task_fits(cfg: Any) -> None:
    """Build the job's samples with the model's tokenizer (no weights) and check each against the task's
    own minimum and the model's window, as the run would after loading the model: a job that cannot run
    is refused before any job starts. Skipped when the tokenizer cannot be loaded (the run then reports
    the missing model itself). Results are cached per (model, task settings)."""
    import json

    from omegaconf import OmegaConf

    task = OmegaConf.to_container(cfg.task, resolve=True)
    path = cfg.model.get("path")
    key = json.dumps([str(cfg.model.name), str(path), task], sort_keys=True, default=str)
    if key not in _FITTED:
        from kvbench.paths import os_error

        try:
            tokenizer, limit = _tokenizer(str(cfg.model.name), str(path) if path else None)
        except KVBenchError:
            return
        except OSError as exc:  # the embedded model's conversion cannot be written (KVBENCH_CACHE)
            raise os_error(exc) from None
        from kvbench.engine import check_lengths
        from kvbench.results import quiet_warnings
        from kvbench.tasks import build_samples

        try:
            with quiet_warnings():  # the job's own build warns about the same samples
                samples = build_samples(str(cfg.task.name), cfg.task, tokenizer, limit)
            for sample in samples:
                check_lengths(sample, limit)
            _FITTED[key] = ""
        except KVBenchError as exc:
            _FITTED[key] = str(exc)
        except OSError as exc:  # a corpus cache that cannot be written (KVBENCH_CACHE)
            _FITTED[key] = str(os_error(exc))
    if _FITTED[key]:
        raise KVBenchError(_FITTED[key])


def check_job(cfg: Any, overrides: list[str]) -> list[Any]:
    """Checks needing the composed config: strategy parameters (by building the strategies), engine and task
    values; ``strategy.*`` overrides are refused when ``strategies=[...]`` would ignore them. Returns the
    strategies built (:func:`validate_cfg`)."""
    if cfg.get("strategies"):
        for o in overrides:
            key = o.split("=", 1)[0].lstrip("+~")
            if key.startswith("strategy.") or key == "strategy":
                first = cfg.strategies[0]
                param = key.split(".", 1)[1] if "." in key else "<param>"
                raise KVBenchError(f"{o} does not apply when strategies=[...] is set; use "
                                   f"strategies_params.{first}.{param}=... (one listed strategy) or "
                                   f"strategies_params.{param}=... (every listed strategy that has it)")
    return validate_cfg(cfg)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def explain(exc: BaseException, overrides: list[str]) -> str:
    """Hydra's composition error as one line that names the valid choices."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    if isinstance(exc, MissingConfigException) and getattr(exc, "options", None) is not None:
        missing = str(getattr(exc, "missing_cfg_file", "") or "")
        group, _, choice = missing.rpartition("/")
        if group:
            return f"unknown {group} {choice!r}; valid: {', '.join(sorted(exc.options))}"
    cause = exc.__cause__ or exc.__context__
    text = str(exc)
    if text.startswith("Could not override '") and isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
        key = text.split("'", 2)[1]
        return _unknown_key(key, overrides)
    if text.startswith("Error merging override") and cause is not None:
        override = text[len("Error merging override"):].strip()
        return f"{override}: {_value_error(cause)}"
    if "Ambiguous value for argument" in text:
        arg = text.split("'", 2)[1]
        return f"{arg} is a sweep: add -m to run one job per value, or write a list as key=[a,b]"
    if "Missing mandatory value" in text or "MissingMandatoryValue" in type(exc).__name__:
        return _first_line(exc).replace("Missing mandatory value: ", "missing required setting ") + " (set it)"
    return _first_line(exc)


def _value_error(cause: BaseException) -> str:
    first = _first_line(cause)
    for marker, word in (("converted to Integer", "an integer"), ("converted to Float", "a number"),
                         ("not a valid bool", "true or false")):
        if marker in first:
            return f"expected {word}"
    return first


def _unknown_key(key: str, overrides: list[str]) -> str:
    """``key`` is not in the config: name the closest valid key (strategy parameters by their strategy)."""
    from hydra import compose
    from omegaconf import DictConfig, OmegaConf

    parent, _, leaf = key.rpartition(".")
    rest = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != key]
    try:
        cfg = compose(config_name="config", overrides=rest)
    except Exception:  # the other overrides fail too; report this one plainly
        return f"unknown key {key}"
    node = OmegaConf.select(cfg, parent) if parent else cfg
    valid = [str(k) for k in node] if isinstance(node, DictConfig) else []
    if parent == "strategy":
        return _no_parameter(str(cfg.strategy.name), leaf, [k for k in valid if k != "name"])
    full = [f"{parent}.{k}" if parent else k for k in valid]
    near = difflib.get_close_matches(key, full, n=1)
    hint = f"; did you mean {near[0]}?" if near else ""
    return f"unknown key {key}; valid: {', '.join(full)}{hint}"


# -- what a composed config runs ---------------------------------------------------------------------------
def node_params(node: Any) -> dict[str, Any]:
    """A composed ``strategy`` node as build parameters (everything but ``name``)."""
    from omegaconf import DictConfig, OmegaConf

    data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    return {k: v for k, v in data.items() if k != "name"}


def _param_names(name: str) -> set[str]:
    from kvbench import strategies

    return {f.name for f in dataclasses.fields(strategies.strategy_class(name))}  # type: ignore[arg-type]


def resolve_strategies(cfg: Any) -> list[Any]:
    """The strategies a job runs, built (so validated) from the composed config, ``full`` first.

    ``strategies=[...]`` starts from each strategy's dataclass defaults; ``strategies_params.<param>`` applies to
    every listed strategy that has the parameter, ``strategies_params.<strategy>.<param>`` to that one only (and
    wins over the shared one). Otherwise the single ``strategy`` node."""
    from omegaconf import DictConfig, OmegaConf

    from kvbench import strategies

    if cfg.get("strategies"):
        names = [str(n) for n in cfg.strategies]
        for n in names:
            strategies.strategy_class(n)  # unknown names first, with the valid ones
        raw = cfg.get("strategies_params")
        given = OmegaConf.to_container(raw, resolve=True) if isinstance(raw, DictConfig) else dict(raw or {})
        own = {k: v for k, v in given.items() if k in names and isinstance(v, dict)}
        shared = {k: v for k, v in given.items() if k not in own}
        for key in shared:
            if key in strategies.available():
                raise KVBenchError(f"strategies_params.{key} names strategy {key!r}, which is not in "
                                   f"strategies=[{','.join(names)}]")
        unused = set(shared) - {k for n in names for k in _param_names(n)}
        if unused:
            raise KVBenchError(f"strategies_params {', '.join(sorted(unused))} matches no parameter of "
                               f"{', '.join(names)}; per strategy: strategies_params.<strategy>.<param>")
        specs = []
        for n in names:
            params = {k: v for k, v in shared.items() if k in _param_names(n)}
            params.update(own.get(n, {}))
            specs.append((n, strategy_params(n, params)))
    else:
        specs = [(str(cfg.strategy.name), node_params(cfg.strategy))]
    built = [strategies.build(name, params) for name, params in specs]
    labels: set[str] = set()
    unique = []
    for s in [strategies.build("full")] + built:
        if s.label() not in labels:
            labels.add(s.label())
            unique.append(s)
    return unique


def validate_cfg(cfg: Any) -> list[Any]:
    """Checks that need no model: engine settings, sample count, and every strategy built from its parameters.

    Returns the strategies the job runs (:func:`resolve_strategies`), built once: a job that
    :func:`check_overrides` already checked in this process gets the ones built then."""
    from kvbench.attention import CHOICES as ATTENTION
    from kvbench.fused import CHOICES as READER
    from kvbench.linear import CHOICES as LINEAR

    if cfg.engine.attention not in ATTENTION:
        raise KVBenchError(f"unknown engine.attention {cfg.engine.attention!r}; valid: {', '.join(ATTENTION)}")
    if cfg.engine.get("linear", "auto") not in LINEAR:
        raise KVBenchError(f"unknown engine.linear {cfg.engine.linear!r}; valid: {', '.join(LINEAR)}")
    if cfg.engine.get("reader", "auto") not in READER:
        raise KVBenchError(f"unknown engine.reader {cfg.engine.reader!r}; valid: {', '.join(READER)}")
    if cfg.engine.prefill not in ("shared", "chunked"):
        raise KVBenchError(f"unknown engine.prefill {cfg.engine.prefill!r}; valid: shared, chunked")
    if cfg.engine.prefill == "chunked" and int(cfg.engine.chunk_tokens) < 1:
        raise KVBenchError(f"engine.chunk_tokens must be >= 1 (got {cfg.engine.chunk_tokens})")
    if int(cfg.engine.batch_size) < 1:
        raise KVBenchError(f"engine.batch_size must be >= 1 (got {cfg.engine.batch_size})")
    if int(cfg.engine.max_new_samples) < 0:
        raise KVBenchError(f"engine.max_new_samples must be >= 0 (got {cfg.engine.max_new_samples})")
    if int(cfg.task.get("n_samples", 1)) < 1:
        raise KVBenchError(f"task.n_samples must be >= 1 (got {cfg.task.n_samples})")
    if str((cfg.get("tracking") or {}).get("name", "none")) == "mlflow":
        from kvbench.tracking import check_available

        check_available()
    from kvbench.paths import check_output_dir

    check_output_dir(cfg.results_dir)
    checked = _CHECKED.pop(_job_key(cfg), None)
    return checked if checked is not None else resolve_strategies(cfg)
