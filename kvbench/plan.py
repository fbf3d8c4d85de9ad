"""``kvbench plan``: how many questions each claim needs to be decided (measurement spec v1.2 §2.4).

From the result store (the default), every verdict of the claim check — the headline's members per scope
and setting, and each scenario claim — with the questions it rests on now and the questions that would
decide it: Connor's paired formula at the observed discordance (its 95% upper bound when none was seen),
never below the zero-flip n, times the design effect (:func:`kvbench.stats.questions_needed`); and, for a
headline member, the least it could ever need (no disagreement at all: the zero-flip n times the design
effect). The first is large at small n on purpose — 8 agreeing questions bound the discordance only at 37%.

Before anything is measured, ``--discordance`` plans one non-inferiority claim from assumptions instead::

    kvbench plan --discordance 0.02 --baseline-accuracy 0.9 --deff 1.3

Bad input ends with one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import NoReturn

from kvbench import claims, stats
from kvbench.errors import KVBenchError
from kvbench.paired import MARGIN_PP
from kvbench.selection import add_design_argument, add_filter_arguments, design_from_args, filters_from_args


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line and exit status 2 (argparse prints the usage too)."""

    def error(self, message: str) -> NoReturn:
        print(f"kvbench plan: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvbench plan",
                description="Questions each claim needs to be decided (spec v1.2 §2.4), from the result store; "
                            "or, with --discordance, for one non-inferiority claim from assumptions.")
    add_filter_arguments(p)
    add_design_argument(p)
    p.add_argument("--discordance", type=float, default=None,
                   help="assumed rate of questions the strategy and full answer differently (0-1); plans one "
                        "claim without reading the store")
    p.add_argument("--net-loss", type=float, default=0.0,
                   help="with --discordance: assumed accuracy loss in points (default 0)")
    p.add_argument("--baseline-accuracy", type=float, default=1.0,
                   help="with --discordance: full's accuracy (0-1, default 1), for the zero-flip floor")
    p.add_argument("--deff", type=float, default=1.0,
                   help="with --discordance: design effect of the clustering (>= 1, default 1)")
    p.add_argument("--observed", type=int, default=0,
                   help="with --discordance 0: questions already seen without a discordance (its upper bound "
                        "is then planned at)")
    p.add_argument("--margin", type=float, default=MARGIN_PP,
                   help=f"with --discordance: non-inferiority margin in points (default {MARGIN_PP:g})")
    return p


def _check_assumptions(args: argparse.Namespace) -> None:
    checks = (
        (0 <= args.discordance <= 1, f"--discordance must be in [0, 1], got {args.discordance:g}"),
        (0 <= args.baseline_accuracy <= 1, f"--baseline-accuracy must be in [0, 1], got {args.baseline_accuracy:g}"),
        (args.deff >= 1, f"--deff must be >= 1, got {args.deff:g}"),
        (0 < args.margin < 100, f"--margin must be in (0, 100) points, got {args.margin:g}"),
        (args.observed >= 0, f"--observed must be >= 0, got {args.observed}"),
        (abs(args.net_loss) / 100 <= args.discordance, "--net-loss cannot exceed the discordance (a loss needs "
                                                       "questions answered differently)"),
    )
    for ok, message in checks:
        if not ok:
            raise KVBenchError(message)
    if args.discordance == 0 and args.observed == 0:
        raise KVBenchError("--discordance 0 needs --observed N: the questions seen without a discordance "
                           "(planning uses its upper bound)")


def plan_assumed(args: argparse.Namespace) -> list[str]:
    """One non-inferiority claim planned from ``args``' assumptions."""
    _check_assumptions(args)
    loss = args.net_loss / 100
    p_loss, p_gain = (args.discordance + loss) / 2, (args.discordance - loss) / 2
    n = stats.questions_needed(p_loss, p_gain, args.observed, args.margin / 100, args.baseline_accuracy, args.deff)
    floor = stats.n_zero_flips(args.margin / 100, args.baseline_accuracy)
    return ["\n".join([f"non-inferiority at −{args.margin:g} point, task accuracy, one-sided {claims.ALPHA:g}, "
            f"{stats.POWER:.0%} power: {n:,} questions" if n else
            f"non-inferiority at −{args.margin:g} point: no number of questions decides it (the assumed loss "
            "is the margin)",
            f"(discordance {args.discordance:g}, net loss {args.net_loss:g} pp, design effect {args.deff:g}; "
            f"zero flips alone need {floor:,} questions at baseline accuracy {args.baseline_accuracy:g})"])]


def _row(setting: str, claim: str, scope: str, subject: str, verdict: str, sizes: str, needed: int,
         floor: int = 0) -> list[str]:
    return [setting, claim, scope, subject, verdict, sizes, f"{needed:,}" if needed else "–",
            f"{floor:,}" if floor else "–"]


def plan_rows(check: claims.ClaimCheck) -> list[list[str]]:
    """(setting, claim, scope, strategy, verdict, questions / documents now, questions to decide, and for a
    headline member that could still hold the least it needs: the zero-flip n times its design effect)."""
    rows = []
    for sc in check.settings:
        for scope in sc.scopes:
            h = sc.headline[scope]
            for m in h.members:
                c = m.comparison
                need = m.questions_needed()
                floor = 0
                if need and c.estimate > -claims.LOSS_PP:  # could still hold: never before zero flips would
                    deff = 1.0 if math.isnan(c.deff) else c.deff
                    rate = 1.0 if math.isnan(c.b_mean) else c.b_mean
                    floor = math.ceil(stats.n_zero_flips(claims.LOSS_PP / 100, round(rate, 3)) * deff)
                docs = "?" if c.n_documents < 0 else str(c.n_documents)
                rows.append(_row(sc.setting, "headline (<1 pt loss)", scope, c.a, m.verdict_text,
                                 f"{c.n_questions} / {docs}", need, floor))
        for r in sc.scenarios:
            if r.measured:
                rows.append(_row(sc.setting, r.scenario.title, r.scenario.task, "–", r.verdict, "–", r.n_needed))
    return rows


def render(rows: list[list[str]]) -> str:
    head = ["setting", "claim", "scope", "strategy", "verdict", "questions / documents now", "questions to decide",
            "at least (zero flips)"]
    table = [head, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in table)


def plan_store(args: argparse.Namespace) -> list[str]:
    from kvbench.leaderboard import build
    from kvbench.results import read_store

    lb = build(read_store(args.results_dir), filters_from_args(args), design=design_from_args(args))
    lines = []
    for setting in lb.settings:
        summary = lb.summary[lb.summary["setting"] == setting]
        records = lb.records[lb.records["setting"] == setting]
        check = claims.check_claims(summary, lb.meta, records, design=lb.design)
        lines.append(render(plan_rows(check)))
    return lines


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvbench plan``; returns the exit status (0 ok, 2 bad input)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        lines = plan_assumed(args) if args.discordance is not None else plan_store(args)
    except KVBenchError as exc:
        print(f"kvbench plan: error: {exc}", file=sys.stderr)
        return 2
    print("\n\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

