"""The one-GPU check's summaries: ``check.json`` (everything) and ``check.md``
(the targets and one table per section), rewritten after every section."""

from __future__ import annotations

import json
import os
from typing import Any

# The targets on the GPU, as (label, section, how to read the value, bound).
TARGETS = (
    ("step time / unwrapped (W=1)", "speed", ("ratios", "step_vs_unwrapped"), "<= 1.02"),
    ("step time / FSDP2 (W=1)", "speed", ("ratios", "step_vs_fsdp2"), "<= 1.00"),
    ("peak allocated / FSDP2", "speed", ("ratios", "peak_vs_fsdp2"), "<= 1.00"),
    ("max_memory_allocated / estimate", "memory", ("measured_over_predicted",), "within 5%"),
    (
        "stress loop equals CUDA_LAUNCH_BLOCKING=1",
        "stress",
        ("identical_to_launch_blocking",),
        "true",
    ),
)


def _get(section: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = section
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def _met(value: Any, bound: str) -> bool | None:
    if value is None:
        return None
    if bound == "true":
        return value is True
    if bound == "within 5%":
        return abs(value - 1.0) <= 0.05
    return value <= float(bound.split()[-1])


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target with its value and whether it is met (``None``: no value,
    and always in a smoke run, whose numbers come from a CPU)."""
    rows = []
    for label, name, path, bound in TARGETS:
        value = _get(report["sections"].get(name, {}), path)
        met = None if report["smoke"] else _met(value, bound)
        rows.append({"target": label, "section": name, "value": value, "bound": bound, "met": met})
    return rows


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "—" if value is None else str(value)


def _checks_table(section: dict[str, Any]) -> list[str]:
    """One row per sub-check of the rank jobs (``w1``, ``w2``, ... entries)."""
    lines = ["| W (backend) | check | ok | numbers |", "|---|---|---|---|"]
    for world, entries in section.items():
        if not (world.startswith("w") and isinstance(entries, dict)):
            continue
        for name, e in entries.items():
            if not isinstance(e, dict) or "ok" not in e:
                continue
            keys = (
                "max_loss_diff",
                "grad_diff",
                "param_diff",
                "shard_devices",
                "pinned",
                "skipped",
                "error",
            )
            numbers = ", ".join(f"{k} {_fmt(e[k])}" for k in keys if k in e)
            w = f"{world[1:]} ({entries.get('backend', '?')})"
            lines.append(f"| {w} | {name} | {_fmt(e['ok'])} | {numbers} |")
    return lines if len(lines) > 2 else []


def _speed_table(section: dict[str, Any]) -> list[str]:
    lines = [
        "| impl | step time (s) | tokens/s | MFU | peak allocated (GiB) |",
        "|---|---|---|---|---|",
    ]
    for impl, r in section.get("results", {}).items():
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "—"
        lines.append(f"| {impl} | {r['step_time_s']:.4f} | {r['tokens_per_s']:,.0f} | {mfu} | "
                     f"{r['peak_allocated_gib']:.2f} |")  # fmt: skip
    return lines


def _details(name: str, section: dict[str, Any]) -> list[str]:
    if name in ("parity", "features"):
        return _checks_table(section)
    if name == "speed":
        return _speed_table(section) + [
            "",
            f"Profiler traces: {', '.join(section.get('traces', []))}",
        ]
    if name == "stress":
        runs = section.get("runs", {})
        return [f"- {k}: digest {r['digest'][:16]}, {r['steps']} steps, {r['seconds']} s, "
                f"loss {r['first_loss']:.4f} -> {r['last_loss']:.4f}" for k, r in runs.items()]  # fmt: skip
    if name == "memory":
        return [f"- predicted {_fmt(section.get('predicted_gib'))} GiB, measured "
                f"{_fmt(section.get('measured_gib'))} GiB ({section.get('measurement')})"]  # fmt: skip
    if name == "tests":
        keys = ("files", "passed", "failures", "errors", "skipped")
        return [f"- {k}: {section[k]}" for k in keys if k in section]
    return []


def markdown(report: dict[str, Any]) -> str:
    """``check.md``: environment, section statuses, the targets, then details."""
    env = report["environment"]
    lines = ["# One-GPU check", ""]
    if report["smoke"]:
        lines += ["**Smoke run (CPU, gloo, tiny models): the numbers below mean nothing.**", ""]
    lines += [f"{report['started']} · {env.get('device')} · torch {env.get('torch')}", ""]
    lines += ["| section | status | seconds |", "|---|---|---|"]
    for name, s in report["sections"].items():
        lines.append(f"| {name} | {s['status']} | {_fmt(s.get('seconds'))} |")
    lines += ["", "## Targets", "", "| target | value | bound | met |", "|---|---|---|---|"]
    for t in targets(report):
        lines.append(f"| {t['target']} | {_fmt(t['value'])} | {t['bound']} | {_fmt(t['met'])} |")
    for name, s in report["sections"].items():
        body = _details(name, s)
        if s.get("error") or s["status"] in ("error", "timeout"):
            where = s.get("error") or f"see logs/{name}.log"
            body = [f"{s['status']}: {where}"] + (["", *body] if body else [])
        if body:
            lines += ["", f"## {name}", "", *body]
    return "\n".join(lines) + "\n"


def write_reports(report: dict[str, Any], out: str) -> None:
    """Writes ``check.json`` and ``check.md`` into ``out`` (atomically each)."""
    data = {**report, "targets": targets(report)}
    for filename, text in (("check.json", json.dumps(data, indent=1, default=str)),
                           ("check.md", markdown(report))):  # fmt: skip
        tmp = os.path.join(out, filename + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out, filename))
