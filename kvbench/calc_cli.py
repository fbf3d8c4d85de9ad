"""``kvbench calc``: the projection of :mod:`kvbench.calc` for a model, context, batch, dtype and hardware profile,
printed with the arithmetic behind every figure (``--json`` for the figures alone), and ``kvbench calc claim``,
the check of a claimed KV-cache size (``docs/projection.md``, ``docs/scaling.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

from kvbench.calc import (
    DEFAULT_RESERVE_FRACTION,
    DEFAULT_SOURCE_MODEL,
    DTYPE_BYTES,
    GB,
    GIB,
    PRESETS,
    ClaimAnalysis,
    MemoryPlan,
    ModelArch,
    analyse_claim,
    bytes_per_element_from_token_bytes,
    check_count,
    check_positive,
    check_reserve,
    dtype_bytes,
    kv_bytes,
    kv_bytes_per_token,
    max_batch,
    max_context,
    memory_plan,
    resolve_model,
)
from kvbench.errors import KVBenchError
from kvbench.hardware import load_profile

# ------------------------------------------------------------------------------------------ output


def fmt_bytes(n: float) -> str:
    """``3,932,160,000 B = 3.93 GB = 3.66 GiB``-style rendering (decimal GB first, as datasheets use)."""
    return f"{n:,.0f} B = {n / GB:,.2f} GB = {n / GIB:,.2f} GiB"


def _notes(arch: ModelArch, context: int | None) -> list[str]:
    notes = []
    if context and arch.max_position_embeddings and context > arch.max_position_embeddings:
        notes.append(f"{arch.name} is configured for at most {arch.max_position_embeddings:,} positions "
                     f"(max_position_embeddings); {context:,} tokens exceeds it — the arithmetic still "
                     "holds for a long-context variant with the same KV shape")
    if arch.sliding_window:
        notes.append(f"{arch.name} uses a {arch.sliding_window:,}-token sliding window; a rolling-buffer "
                     "cache stores at most that many tokens per layer (not modelled: full cache assumed)")
    return notes


def _num(value: float) -> str:
    """Thousands-separated; integers without decimals (327,680), fractions to four places (0.6250)."""
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.4f}"


def _print_rows(title: str, rows: list[tuple[str, str]], notes: list[str], explain: list[str] | None = None
                ) -> None:
    from rich.console import Console
    from rich.table import Table

    # Piped output (files, pytest) would otherwise wrap at rich's 80-column default.
    console = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 120)
    table = Table(title=title, show_header=False)
    table.add_column("quantity", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
    for line in explain or []:
        console.print(f"  {line}", highlight=False)
    for note in notes:
        console.print(f"note: {note}", highlight=False)


def _explain_lines(arch: ModelArch, context: int | None, batch: int, bpe: float,
                   plan: MemoryPlan | None, weight_bpp: float) -> list[str]:
    lines = [f"KV bytes per token = 2 × {arch.num_layers} layers × {arch.num_kv_heads} KV heads × "
             f"{arch.head_dim} head_dim × {bpe:g} B = {_num(kv_bytes_per_token(arch, bpe))} B"]
    if context:
        total = kv_bytes(arch, context, batch, bpe)
        lines.append(f"KV bytes = {_num(kv_bytes_per_token(arch, bpe))} B × {context:,} tokens × {batch} "
                     f"batch = {fmt_bytes(total)}")
    if plan is not None:
        lines.append(f"usable = {plan.budget_bytes:,} B × (1 − {plan.reserve_fraction:g} reserve) = "
                     f"{plan.usable_bytes:,.0f} B")
        lines.append(f"weights = {arch.params:,} params × {weight_bpp:g} B = {fmt_bytes(plan.weight_bytes)}")
        lines.append(f"left for KV = usable − weights = {plan.usable_bytes - plan.weight_bytes:,.0f} B")
    return lines


def _resolve_bpe(args: argparse.Namespace) -> tuple[float, str]:
    """Bytes per KV element and a sentence saying where it came from."""
    if args.bytes_per_element is not None and args.strategy_bytes_per_token is not None:
        raise KVBenchError("give either --bytes-per-element or --strategy-bytes-per-token, not both")
    if args.bytes_per_element is not None:
        check_positive("--bytes-per-element", args.bytes_per_element)
        return args.bytes_per_element, "given (--bytes-per-element)"
    if args.strategy_bytes_per_token is not None:
        source = resolve_model(args.source_model)
        bpe = bytes_per_element_from_token_bytes(args.strategy_bytes_per_token, source)
        return bpe, (f"{args.strategy_bytes_per_token:g} B/token measured on {source.name} ÷ "
                     f"{source.kv_elements_per_token:,} elements/token")
    dtype = args.dtype or "fp16"
    return dtype_bytes(dtype), f"dtype {dtype}"


def _weight_bpp(args: argparse.Namespace) -> float:
    if args.weight_bytes_per_param is not None:
        check_positive("--weight-bytes-per-param", args.weight_bytes_per_param)
        return args.weight_bytes_per_param
    return dtype_bytes(args.weight_dtype)


def project(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``kvbench calc`` reports, as plain data (the ``--json`` output)."""
    if args.context is None and args.hardware is None:
        raise KVBenchError("give --context (KV size) and/or --hardware (what fits)")
    if args.context is not None:
        check_count("--context", args.context)
    check_count("--batch", args.batch)
    check_reserve(args.reserve)
    arch = resolve_model(args.model, params=args.params)
    bpe, bpe_origin = _resolve_bpe(args)
    result: dict[str, Any] = {
        "model": asdict(arch), "bytes_per_element": bpe, "bytes_per_element_origin": bpe_origin,
        "batch": args.batch, "context": args.context, "kv_bytes_per_token": kv_bytes_per_token(arch, bpe),
        "notes": _notes(arch, args.context),
    }
    if args.context is not None:
        result["kv_bytes"] = kv_bytes(arch, args.context, args.batch, bpe)
    if args.hardware is not None:
        hw = load_profile(args.hardware)
        weight_bpp = _weight_bpp(args)
        options = {"weight_bytes_per_param": weight_bpp, "reserve_fraction": args.reserve}
        plan = memory_plan(arch, hw, args.context or 0, args.batch, bpe, **options)
        result.update({
            "hardware": hw.name, "memory_bytes": hw.memory_bytes, "reserve_fraction": args.reserve,
            "usable_bytes": plan.usable_bytes, "weight_bytes_per_param": weight_bpp,
            "weight_bytes": plan.weight_bytes,
            "max_context_at_batch": max_context(arch, hw, args.batch, bpe, **options),
        })
        if args.context is not None:
            result["fits"] = plan.fits
            result["free_bytes"] = plan.free_bytes
            result["max_batch_at_context"] = max_batch(arch, hw, args.context, bpe, **options)
        limit = arch.max_position_embeddings
        if limit and result["max_context_at_batch"] > limit:
            result["notes"].append(f"memory allows {result['max_context_at_batch']:,} tokens per sequence, but "
                                   f"{arch.name} is configured for {limit:,} positions")
        if plan.weight_bytes > plan.usable_bytes:
            result["notes"].append(f"the weights alone ({plan.weight_bytes / GB:,.1f} GB) exceed the usable "
                                   f"{plan.usable_bytes / GB:,.1f} GB of {hw.name}: shard or quantise them "
                                   "(--weight-dtype / --weight-bytes-per-param)")
        result["explain"] = _explain_lines(arch, args.context, args.batch, bpe, plan, weight_bpp)
    else:
        result["explain"] = _explain_lines(arch, args.context, args.batch, bpe, None, 0.0)
    return result


def _print_projection(r: dict[str, Any], explain: bool) -> None:
    m = r["model"]
    rows = [
        ("model", f"{m['name']}: {m['num_layers']} layers, {m['num_kv_heads']} KV heads "
                  f"({m['num_attention_heads']} query heads), head_dim {m['head_dim']}"),
        ("params", "unknown" if m["params"] is None else f"{m['params']:,}"),
        ("bytes / KV element", f"{r['bytes_per_element']:.4g} ({r['bytes_per_element_origin']})"),
        ("KV bytes / token", _num(r["kv_bytes_per_token"])),
    ]
    if r.get("kv_bytes") is not None:
        rows.append((f"KV cache @ {r['context']:,} tok × batch {r['batch']}", fmt_bytes(r["kv_bytes"])))
    if "hardware" in r:
        rows += [
            ("hardware", f"{r['hardware']}: {fmt_bytes(r['memory_bytes'])}"),
            (f"usable (reserve {r['reserve_fraction']:g})", fmt_bytes(r["usable_bytes"])),
            (f"weights ({r['weight_bytes_per_param']:g} B/param)", fmt_bytes(r["weight_bytes"])),
        ]
        if "fits" in r:
            verdict = "yes" if r["fits"] else "no"
            rows.append(("fits", f"{verdict} ({'free' if r['fits'] else 'short by'} "
                                 f"{abs(r['free_bytes']) / GB:,.2f} GB)"))
            rows.append((f"max batch @ {r['context']:,} tok", f"{r['max_batch_at_context']:,}"))
        rows.append((f"max context @ batch {r['batch']}", f"{r['max_context_at_batch']:,} tokens"))
    _print_rows("kvbench calc", rows, r["notes"], r["explain"] if explain else None)


def _print_claim(c: ClaimAnalysis, extra_notes: list[str]) -> None:
    rows = [
        ("claim", f"{c.model} at {c.context:,} tokens needs {c.claimed_bytes / GB:,.4g} GB of KV cache"),
        ("KV bytes / token", f"{_num(c.per_token_bytes)} B at {c.bytes_per_element:g} B/element"),
        ("true size, batch 1", fmt_bytes(c.actual_bytes)),
        ("claim ÷ true size", f"{c.implied_batch:.2f}× — the claim holds at batch {c.implied_batch:.2f}"),
        (f"batch {c.batch_below}", fmt_bytes(c.bytes_below)),
        (f"batch {c.batch_above}", fmt_bytes(c.bytes_above)),
        ("claimed size at batch 1 is reached at", f"{c.context_for_claim:,} tokens"),
        (f"without GQA ({c.mha_kv_heads} KV heads), batch 1", fmt_bytes(c.mha_bytes)),
        ("without GQA, claimed size reached at", f"{c.mha_context_for_claim:,} tokens"),
    ]
    rows += [(f"reading: {label}", f"{value / GB:,.2f} GB") for label, value in c.readings]
    notes = [
        f"2 × layers × kv_heads × head_dim × context × bytes = {c.per_token_bytes:,.0f} × {c.context:,} "
        f"= {c.actual_bytes:,.0f} B per sequence",
        f"{c.claimed_bytes:,.0f} ÷ {c.actual_bytes:,.0f} = {c.implied_batch:.4f} sequences",
        f"if the claim meant GiB ({c.claimed_bytes / GB * GIB:,.0f} B) the batch is "
        f"{c.claimed_bytes / GB * GIB / c.actual_bytes:.2f}",
    ]
    _print_rows("KV-cache claim check", rows, notes + extra_notes)


# --------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """Parser for ``kvbench calc`` (projection); ``kvbench calc claim`` uses :func:`claim_parser`."""
    p = argparse.ArgumentParser(
        prog="kvbench calc",
        description="Project KV-cache memory for a model and check what fits on a hardware profile. "
                    "`kvbench calc claim --help` checks a claimed KV size.")
    p.add_argument("--model", required=True,
                   help=f"preset ({', '.join(PRESETS)}) or path to a config.json / model directory")
    p.add_argument("--context", type=int, default=None, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPE_BYTES), help="KV dtype (default fp16)")
    p.add_argument("--bytes-per-element", type=float, default=None,
                   help="measured bytes per KV element of a strategy (overrides --dtype)")
    p.add_argument("--strategy-bytes-per-token", type=float, default=None,
                   help="measured KV bytes per token of a strategy on --source-model "
                        "(converted to bytes/element)")
    p.add_argument("--source-model", default=DEFAULT_SOURCE_MODEL,
                   help=f"model the bytes/token were measured on (default {DEFAULT_SOURCE_MODEL})")
    p.add_argument("--hardware", default=None, help="hardware profile name or YAML path (enables fit checks)")
    p.add_argument("--weight-dtype", default="bf16", choices=sorted(DTYPE_BYTES),
                   help="weight dtype (default bf16)")
    p.add_argument("--weight-bytes-per-param", type=float, default=None, help="overrides --weight-dtype")
    p.add_argument("--params", type=int, default=None, help="parameter count (overrides the preset/config)")
    p.add_argument("--reserve", type=float, default=DEFAULT_RESERVE_FRACTION,
                   help="fraction of device memory held back for activations and runtime buffers "
                        "(default 0.1)")
    p.add_argument("--explain", action="store_true", help="print the arithmetic step by step")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def claim_parser() -> argparse.ArgumentParser:
    """Parser for ``kvbench calc claim``; defaults are the source document's claim."""
    p = argparse.ArgumentParser(prog="kvbench calc claim",
                                description="Check a claimed KV-cache size against the arithmetic. Defaults: "
                                            "'Llama-3-70B at 12,000 tokens needs ~48 GB of KV cache'.")
    p.add_argument("--model", default="llama-3-70b", help="preset or config path (default llama-3-70b)")
    p.add_argument("--context", type=int, default=12000, help="tokens (default 12000)")
    p.add_argument("--claimed-gb", type=float, default=48.0,
                   help="claimed size in GB, 1e9 bytes (default 48)")
    p.add_argument("--dtype", default="fp16", choices=sorted(DTYPE_BYTES), help="KV dtype (default fp16)")
    p.add_argument("--bytes-per-element", type=float, default=None, help="overrides --dtype")
    p.add_argument("--json", action="store_true", help="print the analysis as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``kvbench calc``; returns the exit status (0 ok, 2 bad input)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    is_claim = bool(argv) and argv[0] == "claim"
    try:
        args = (claim_parser() if is_claim else build_parser()).parse_args(argv[1:] if is_claim else argv)
    except SystemExit as exc:  # argparse exits on --help (0) and on bad arguments (2)
        return int(exc.code or 0)
    try:
        if is_claim:
            bpe = args.bytes_per_element if args.bytes_per_element is not None else dtype_bytes(args.dtype)
            arch = resolve_model(args.model)
            analysis = analyse_claim(arch, args.context, args.claimed_gb * GB, bpe)
            if args.json:
                print(json.dumps(analysis.to_dict(), indent=2))
            else:
                _print_claim(analysis, _notes(arch, args.context))
            return 0
        result = project(args)
    except KVBenchError as exc:
        print(f"kvbench calc: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_projection(result, args.explain)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
