"""``kvbench design``: the confirmatory study as a template, registered for your model and hardware in one command.

    kvbench design NAME model=local model.path=~/Llama-3.1-8B hardware=server-gpu-80g [--discordance 0.025]
        [--deff 1.15] [--power 0.8] [--look-every 20] [--geometry llama-3-8b] [--commit] [--run]

writes ``conf/design/NAME.yaml`` and ``conf/sweep/NAME.yaml`` from the shipped study (``conf/design/confirm.yaml``
and ``conf/sweep/confirm.yaml``): the same members, margin, statistic, futility, looks and multiplicity, your
overrides in the sweep (checked by composing them, as a run would), a store of its own (``results/NAME``), a seed
of its own, and ``planned_contexts`` planned afresh from your assumptions (:func:`kvbench.registration.
planned_contexts`). It prints what the planned n costs on the hardware profile (a roofline estimate: prefill at
40% of the profile's peak FLOPs, each decoded token reading the weights and the cache at its memory bandwidth).
The design must be committed before the sweep's first record (:mod:`kvbench.registration` refuses it otherwise):
``--commit`` commits both files, ``--run`` then starts the sweep in rounds. Bad input: one line, exit status 2.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import subprocess
import sys
from typing import Any, NoReturn

import yaml

from kvbench.errors import KVBenchError
from kvbench.paths import conf_dir

TEMPLATE = "confirm"
#: Share of peak FLOPs a prefill reaches in the cost estimate (what dense bf16 prefill typically gets on a GPU).
PREFILL_MFU = 0.4
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_-")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"kvbench design: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvbench design", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", help="the study's name: conf/design/NAME.yaml, conf/sweep/NAME.yaml, results/NAME")
    p.add_argument("overrides", nargs="*", help="run overrides for every job, e.g. model=local model.path=... "
                                                "hardware=server-gpu-80g")
    p.add_argument("--discordance", type=float, default=None, help="assumed discordance (default: the template's)")
    p.add_argument("--deff", type=float, default=None, help="assumed design effect (default: the template's)")
    p.add_argument("--power", type=float, default=None, help="power for a pooled member (default: the template's)")
    p.add_argument("--look-every", type=int, default=None, help="contexts per task between looks")
    p.add_argument("--geometry", default=None, help="calc preset or config.json for the cost estimate (default: "
                                                   "model.path, else the model's name)")
    p.add_argument("--force", action="store_true", help="overwrite existing (uncommitted) files")
    p.add_argument("--commit", action="store_true", help="git-commit both files (the registration)")
    p.add_argument("--run", action="store_true", help="after --commit, start the sweep (kvbench sweep NAME)")
    return p


def _override_map(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise KVBenchError(f"override {item!r} is not key=value")
        out[key.lstrip("+")] = value
    return out


def make_files(name: str, overrides: list[str], assumptions: dict[str, Any], look_every: int | None,
               ) -> tuple[dict, dict]:
    """The design and sweep mappings for ``name`` from the template, with ``overrides`` and the planning
    ``assumptions`` (keys of the design's ``planning`` block) applied and ``planned_contexts`` planned afresh."""
    from kvbench import registration

    if not name or set(name) - NAME_CHARS or name == TEMPLATE:
        raise KVBenchError(f"design name {name!r}: use lower-case letters, digits, - and _ (not {TEMPLATE!r})")
    design = yaml.safe_load((conf_dir() / "design" / f"{TEMPLATE}.yaml").read_text())
    sweep = yaml.safe_load((conf_dir() / "sweep" / f"{TEMPLATE}.yaml").read_text())
    seed = int(hashlib.sha256(name.encode()).hexdigest()[:6], 16) % 90000 + 10000  # its own, from its name
    given = _override_map(overrides)
    fixed = {**_override_map(sweep["overrides"]), "results_dir": f"results/{name}", "task.seed": str(seed),
             "task.first_context": "0", **given}
    sweep.update(name=name, description=f"the confirmatory study ({TEMPLATE}) registered for {name}",
                 overrides=[f"{k}={v}" for k, v in fixed.items()])
    planning = {**design["planning"], **{k: v for k, v in assumptions.items() if v is not None},
                "questions_per_context": int(fixed.get("task.questions_per_context", 1)),
                "tasks": len(sweep["axes"]["task"])}
    planning["source"] = f"kvbench design {name}: assumptions as given (template: conf/design/{TEMPLATE}.yaml)"
    every = int(look_every or design["look_every"])
    if every < 1 or not 0 < float(planning["discordance"]) <= 1 or float(planning["design_effect"]) < 1 \
            or not 0 < float(planning["power"]) < 1:
        raise KVBenchError("need --look-every >= 1, --discordance in (0, 1], --deff >= 1 and --power in (0, 1)")
    planned = registration.planned_contexts(planning, float(design["alpha"]), float(design["margin_pp"]), every,
                                            str(design["spending"]), float(design["futility"]["beta"]))
    design.update(name=name, sweep=name, planning=planning, planned_contexts=planned, look_every=every,
                  samples={**design["samples"], "seed": seed, "first_context": 0, "pool": fixed.get("task.pool")})
    if set(given) & {"model", "model.path", "hardware", "model.dtype"}:
        design.pop("reader", None)  # the reader is the target machine's; its records name it (spec §5.1)
    sweep["overrides"] = [o for o in sweep["overrides"] if not o.startswith("task.n_samples=")] + [
        f"task.n_samples={planned}"]
    return design, sweep


def cost_text(design: dict, sweep: dict, geometry: str | None) -> str:
    """The planned study's cost on its hardware profile, by roofline (see the module docstring)."""
    from kvbench import calc
    from kvbench.hardware import load_profile

    o = _override_map(sweep["overrides"])
    arch = calc.resolve_model(geometry or o.get("model.path") or o.get("model", "smollm2-135m"))
    hw = load_profile(o.get("hardware", "cpu"))
    tokens, q = int(o.get("task.context_tokens", 4096)), int(o.get("task.questions_per_context", 8))
    members = len(design["members"]) + 1
    contexts = int(design["planned_contexts"]) * int(design["planning"]["tasks"])
    params = arch.params or 0
    prefill = 2 * params * tokens / (hw.peak_flops * PREFILL_MFU)
    per_token = (calc.weight_bytes(arch) + calc.kv_bytes(arch, tokens)) / (hw.device_mem_bw_gbps * 1e9)
    new_tokens = 12 + 40  # a short answer, and the question read through the compressed cache
    seconds = contexts * (prefill + members * q * new_tokens * per_token)
    return (f"cost at the planned n on {hw.name} (roofline: prefill at {PREFILL_MFU:.0%} of {hw.peak_flops:.3g} "
            f"FLOP/s, decode at {hw.device_mem_bw_gbps:g} GB/s; {arch.name}, {params / 1e9:.2f}B params): "
            f"{contexts} contexts x ({prefill:.2f} s prefill + {members} strategies x {q} questions x "
            f"{new_tokens} tokens x {per_token * 1e3:.2f} ms) = {seconds / 3600:.1f} device-hours at most "
            "(futility and early decisions stop most members sooner)")


def _git(*args: str) -> None:
    out = subprocess.run(["git", *args], capture_output=True, text=True, check=False)
    if out.returncode:
        raise KVBenchError(f"git {' '.join(args)}: {(out.stderr or out.stdout).strip().splitlines()[-1]}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from kvbench.config import compose_config

        assumptions = {"discordance": args.discordance, "design_effect": args.deff, "power": args.power}
        design, sweep = make_files(args.name, args.overrides, assumptions, args.look_every)
        compose_config([o for o in sweep["overrides"]])  # the overrides as a run will read them
        paths = [conf_dir() / "design" / f"{args.name}.yaml", conf_dir() / "sweep" / f"{args.name}.yaml"]
        if not args.force and any(p.exists() for p in paths):
            raise KVBenchError(f"{' or '.join(str(p) for p in paths if p.exists())} exists; --force overwrites")
        if args.run and not args.commit:
            raise KVBenchError("--run needs --commit: the design is registered by its commit, before any record")
        head = f"# Registered for {args.name} by `kvbench design` from conf/design/{TEMPLATE}.yaml; commit it " \
               "before the sweep's first record.\n"
        paths[0].write_text(head + yaml.safe_dump(design, sort_keys=False, width=110))
        paths[1].write_text(head + yaml.safe_dump(sweep, sort_keys=False, width=110))
        print(f"wrote {paths[0]} and {paths[1]}: {design['planned_contexts']} contexts per task planned "
              f"({math.ceil(design['planned_contexts'] / design['look_every'])} looks), "
              f"{len(design['members'])} members")
        try:
            print(cost_text(design, sweep, args.geometry))
        except (KVBenchError, OSError, ValueError) as exc:
            print(f"(no cost estimate: {exc}; name a geometry with --geometry)")
        if args.commit:
            _git("add", *map(str, paths))
            _git("commit", "-q", "-m", f"Register the confirmatory design {args.name} (kvbench design)")
            print(f"registered: committed {paths[0].name} and {paths[1].name}")
        else:
            print(f"register it: git add {paths[0]} {paths[1]} && git commit; then kvbench sweep {args.name}")
    except KVBenchError as exc:
        print(f"kvbench design: error: {exc}", file=sys.stderr)
        return 2
    if args.run:
        from kvbench import sweep as sweep_cli

        return int(sweep_cli.main([args.name]) or 0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
