"""run.sh's one results table: its steps, then capture_check.py's rows under its own step. Stdlib only.

    python benchmark/gpu_check/report.py --steps STEPS.tsv [--capture CAPTURE.json] [--title T] [--out FILE.md]

STEPS.tsv: one line per check, `check<TAB>result<TAB>seconds<TAB>detail` (result: pass, FAIL, skip, ok,
missing, info, timeout). Exit 1 when a row failed (FAIL or timeout), 2 when a check was skipped
(pytest -m gpu or capture_check: nothing failed, but the GPU was not exercised), else 0.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FAILED = ("FAIL", "timeout")
COLUMNS = ("check", "dtype", "page size", "max error", "result", "time", "detail")


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def read_steps(path: Path) -> list[dict]:
    steps = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        parts = (line.split("\t") + ["", "", "", ""])[:4]
        check, result, seconds, detail = parts
        steps.append(dict(check=check, result=result or "?", time=f"{seconds} s" if seconds else "", detail=detail))
    return steps


def capture_rows(path: Path) -> tuple[str, list[dict]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return "", [dict(check="capture: (no results)", result="FAIL", detail=f"capture_check wrote no results: {err}")]
    rows = [dict(check=f"capture: {r['case']}", dtype=r["dtype"], **{"page size": r["page_size"]},
                 **{"max error": r["max_error"]}, result=r["result"], detail=r["detail"])
            for r in data.get("rows", [])]
    return data.get("label", ""), rows


def render(steps: list[dict], capture: tuple[str, list[dict]] | None, title: str) -> str:
    rows = []
    for step in steps:
        rows.append(step)
        if step["check"].startswith("capture_check") and capture is not None:
            rows.extend(capture[1])
    if capture is not None and not any(s["check"].startswith("capture_check") for s in steps):
        rows.extend(capture[1])
    lines = [f"## {title}", ""] if title else []
    if capture is not None and capture[0]:
        lines += [f"Capture kernel: {capture[0]}", ""]
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|" + "---|" * len(COLUMNS))
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in COLUMNS) + " |")
    failed = [r["check"] for r in rows if r.get("result") in FAILED]
    skipped = [r["check"] for r in rows if r.get("result") == "skip" and not r["check"].startswith("capture: ")]
    if failed:
        overall = "FAIL (" + ", ".join(failed) + ")"
    elif skipped:
        overall = "INCOMPLETE (skipped: " + ", ".join(skipped) + ")"
    else:
        overall = "pass"
    lines += ["", f"Overall: {overall}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=Path, required=True)
    parser.add_argument("--capture", type=Path)
    parser.add_argument("--title", default="")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    steps = read_steps(args.steps) if args.steps.exists() else []
    capture = capture_rows(args.capture) if args.capture else None
    text = render(steps, capture, args.title)
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 1 if "Overall: FAIL" in text else 2 if "Overall: INCOMPLETE" in text else 0


if __name__ == "__main__":
    sys.exit(main())
