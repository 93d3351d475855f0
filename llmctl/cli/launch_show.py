"""What `llmctl launch --dry-start` shows: rank 0's setup next to estimate-memory's figures (rendering only; the
numbers are llmctl.launch.dry_start's)."""

from __future__ import annotations

from typing import Any


def render_dry_start(r: dict[str, Any]) -> str:
    from llmctl.units import fmt_bytes

    t = r["timings_s"]
    mesh = " x ".join(f"{n} {d}" for n, d in zip(r["mesh"], r["mesh_dims"], strict=True))
    out = [
        f"plan {r['plan']}: rank {r['rank']} of {r['world_size']} set up in {r['seconds']:.1f} s "
        f"(model on meta {t['build on meta']:.1f} s, sharding {t['parallelize']:.1f} s, "
        f"materialize {t['materialize']:.1f} s)",
        f"  mesh {mesh}; model {r['params']:,} parameters ({r['layer_params']:,} per layer); {r['init']}",
        f"  data: {r['data']}",
        "",
        f"  {'rank ' + str(r['rank']) + ' holds':<22}{'this run':>14}{'estimate-memory':>18}{'ratio':>9}",
    ]
    for line in r["lines"]:
        how = "" if line["line"] == "parameters" or line["allocated_bytes"] is not None else " (sized)"
        est, ratio = line["estimate_bytes"], line["ratio"]
        out.append(
            f"  {line['line'] + how:<22}{fmt_bytes(line['bytes']):>14}"
            f"{fmt_bytes(est) if est else '-':>18}{f'{ratio:.3f}' if ratio else '-':>9}"
        )
    out += [
        "",
        f"  peak resident memory of this process: {fmt_bytes(r['rss_peak_bytes'])} "
        f"({fmt_bytes(r['rss_before_model_bytes'])} before the model)",
    ]
    out += [f"  note: {n}" for n in r["notes"]]
    out.append("the plan starts: launch it without --dry-start")
    return "\n".join(out)
