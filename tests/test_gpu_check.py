"""scripts/gpu_check.py (issue 19 ask 6) must run unchanged the first time a GPU is lent: every section runs
here with the CPU as the device on a tiny Llama-GQA (and the tiny DeepSeek-V3 for MLA), writes one JSON, and
fails (exit 1) when a check fails. The device-vs-CPU differences are 0 by construction on the CPU; the
other checks (sweep vs the naive loop, f(100 %) = 1, the task metrics) are real."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_every_section_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--quick",
                           "--model", "tiny-llama", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    want = {"load", "capture", "scan", "sweep", "path_patch", "edge_attribution", "task_circuits", "mla"}
    assert set(res["sections"]) == want
    assert res["errors"] == [] and res["failed_checks"] == []
    assert all(isinstance(v, dict) for v in res["sections"].values())
    assert res["sections"]["sweep"]["vs_naive_max_abs_diff_nats"] <= 1e-4
    assert res["sections"]["capture"]["cpu_calls"] == 0
