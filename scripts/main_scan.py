"""The README's main job in ONE process: ``qkcircuits scan`` (with the causal check), ``diagnose``, ``report``.

    python scripts/main_scan.py [--model smollm2-135m] [--out out] [--stem smollm2] [--confirm 5] [--prompt TEXT] [scan args]

``bash scripts/dev.sh scan`` runs this. It is the three CLI commands the script used to run one after
another (same arguments, same outputs: ``out/smollm2-{scan.json,scan.csv,diagnostics.json,diagnostics.txt,
report.html}``), but the model is loaded once and shared, so the contextual corpus pass that the scan's
``ov_copying`` makes (cached per model, ``qkcircuits._weights.contextual.corpus_stats``) is the one the
report's QK/OV panels read: one load, one corpus pass instead of three loads and two passes.
Each command still runs through its own ``run(args)`` with the arguments the CLI parses, so flags and
errors stay those of ``qkcircuits``; a bad argument is one ``error:`` line, exit 2, and an output is
only written (atomically) by the step that makes it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time
from pathlib import Path
from typing import List


def _steps(model: str, out: Path, stem: str, confirm: str, prompt, extra: List[str]) -> List[List[str]]:
    return [
        ["scan", model, "--text", "--confirm", confirm, "--json", str(out / f"{stem}-scan.json"),
         "--csv", str(out / f"{stem}-scan.csv"), *extra],
        ["diagnose", model, "--json", str(out / f"{stem}-diagnostics.json")],
        ["report", model, "--scores", str(out / f"{stem}-scan.json"), "--diagnostics",
         str(out / f"{stem}-diagnostics.json"), "-o", str(out / f"{stem}-report.html"),
         *(["--prompt", prompt] if prompt else [])],
    ]


def run(argv: List[str]) -> int:
    from qkcircuits.cli import build_parser
    from qkcircuits.cli import _common, diagnose_command as diagnose, report_command as report, scan_command as scan
    from qkcircuits._foundation.errors import QKCircuitsError
    from qkcircuits._foundation.io import check_writable

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default="out")
    ap.add_argument("--stem", default="smollm2")
    ap.add_argument("--confirm", default="5", help="the scan's causal check: top-K induction heads (default 5)")
    ap.add_argument("--prompt", default=None, help="the report's attention-pattern prompt (default: the report's)")
    known, extra = ap.parse_known_args(argv)
    out = Path(known.out)
    parser = build_parser()
    try:
        steps = [parser.parse_args(s) for s in _steps(known.model, out, known.stem, known.confirm, known.prompt, extra)]
        for args in steps:
            for name in ("json", "csv", "output"):
                if getattr(args, name, None):
                    check_writable(getattr(args, name))
        t0 = time.perf_counter()
        model = _common.load_model(steps[0])                  # the one load every step shares
        print(f"main_scan: model loaded once in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        shared = lambda args: model                            # noqa: E731
        modules = (scan, diagnose, report)
        saved = [m.load_model for m in modules]
        try:
            for m in modules:
                m.load_model = shared
            t = time.perf_counter()
            scan.run(steps[0])
            print(f"main_scan: scan {time.perf_counter() - t:.1f} s", file=sys.stderr)
            t = time.perf_counter()
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                diagnose.run(steps[1])
            tmp = out / f".{known.stem}-diagnostics.txt.tmp"
            tmp.write_text(text.getvalue(), encoding="utf-8")
            os.replace(tmp, out / f"{known.stem}-diagnostics.txt")
            print(f"main_scan: diagnose {time.perf_counter() - t:.1f} s", file=sys.stderr)
            t = time.perf_counter()
            report.run(steps[2])
            print(f"main_scan: report {time.perf_counter() - t:.1f} s; all {time.perf_counter() - t0:.1f} s",
                  file=sys.stderr)
        finally:
            for m, f in zip(modules, saved):
                m.load_model = f
    except QKCircuitsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
