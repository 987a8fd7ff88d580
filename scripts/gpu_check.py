"""The one prepared script for a GPU session: every hot path on the device against the CPU, one JSON.

    python scripts/gpu_check.py --device cuda --out gpu_check.json       # on the lent GPU (<= 5 min)
    python scripts/gpu_check.py --device cpu --quick --out cpu.json      # every section on this CPU (SmolLM2)
    python scripts/gpu_check.py --device cpu --quick --model tiny-llama  # seconds: a tiny Llama-GQA, no download

Sections (each guarded: a failure is recorded in the JSON as ``"error: ..."`` and the next one still
runs; the JSON is written even if a section fails):

- ``load``: the model, its device and dtype; ``capture``: q/k/pattern with ``Tensor.cpu`` counted
  (must be 0: no hidden round trips), q equal to the normalised residual times W_Q;
- ``scan``: the top induction heads (SmolLM2: 18.6, 17.3, 17.4 on the CPU);
- ``sweep``: a batched zero-ablation sweep of two layers against the naive loop on the device
  (<= 1e-4 nats) and against the same sweep on the CPU;
- ``path_patch`` / ``edge_attribution``: exact path patching and the gradient estimate of a few
  receivers' K input on the device against the CPU, and against each other (Spearman);
- ``task_circuits``: ``qk.tasks.ioi`` (or ``qk.tasks.induction`` where the tokenizer has too few
  single-token names), ``qk.edge_scores`` EAP on the device vs the CPU, EAP-IG, ``qk.faithfulness``
  (the 100 % circuit must reproduce the clean metric: f = 1);
- ``mla``: a tiny random DeepSeek-V3 (multi-head latent attention, ``tests/_tiny.py``): patterns, exact
  path patching and EAP edge scores on the device vs the CPU.

``--device cpu`` runs the same code with the CPU as "device" (device-vs-CPU differences are then 0 by
construction; the other checks are real). ``--quick`` shrinks the prompt counts (for a CPU run);
the GPU sizes are the defaults. Budget on one GPU: <= 5 minutes in all (``total_seconds`` in the JSON).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import qkcircuits as qk  # noqa: E402
from qkcircuits._analysis.sweep import naive_sweep  # noqa: E402
from qkcircuits._foundation.stats import spearman  # noqa: E402

TINY = "tiny-llama"          # a tiny random Llama-GQA from tests/_tiny.py (no download): the quickest run
SMOLLM2_TOP_INDUCTION = ["18.6", "17.3", "17.4"]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def section(name: str, res: dict) -> Callable:
    """Run one guarded check: its dict lands in res["sections"][name]; errors are recorded, not raised."""
    def wrap(fn):
        _sync()
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001  (the script must run to the end and write its JSON)
            out = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        _sync()
        if isinstance(out, dict):
            out["seconds"] = round(time.perf_counter() - t0, 3)
        res["sections"][name] = out
        print(f"{name:<18} {json.dumps(out)[:400]}", flush=True)
        return out
    return wrap


def _max_diff(a, b) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    keep = ~(a.isnan() | b.isnan())
    return float((a[keep] - b[keep]).abs().max()) if bool(keep.any()) else 0.0


def _rho(a, b) -> float:
    a, b = a.detach().float().cpu().flatten(), b.detach().float().cpu().flatten()
    keep = ~(a.isnan() | b.isnan())
    return float(spearman(a[keep], b[keep]))


def _tiny():
    sys.path.insert(0, str(ROOT / "tests"))
    import _tiny

    return _tiny


def _load(spec: str, device: str, tmp: Path):
    if spec == TINY:
        folder = tmp / "tiny-llama"
        if not folder.exists():
            _tiny().tiny_llama_gqa(folder)
        spec = str(folder)
    return qk.load(spec, device=device, verbose=False)


def _task(model, n: int):
    """IOI where the tokenizer has the single-token names it needs, else the induction task."""
    try:
        return qk.tasks.ioi(model, n=n), "ioi"
    except qk.QKCircuitsError:
        return qk.tasks.induction(model, n=n, seg_len=6), "induction"


def run(args) -> dict:
    res: dict = {"sections": {}, "torch": torch.__version__, "python": platform.python_version(),
                 "model": args.model, "quick": bool(args.quick), "argv": sys.argv[1:]}
    t_start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    n_seq, n_small = (4, 2) if args.quick else (8, 4)
    n_task = 4 if args.quick else 16
    st: Dict[str, object] = {}

    @section("load", res)
    def _():
        st["model"] = m = _load(args.model, args.device, tmp)
        dev = m.W_E.device
        st["cpu"] = m if dev.type == "cpu" else _load(args.model, "cpu", tmp)
        st["toks"] = qk.repeated_tokens(m, n_seq, 40 if not args.quick else 20, seed=0).to(dev)
        return {"device": str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""),
                "dtype": str(m.W_Q.dtype), "n_layers": int(m.cfg.n_layers), "n_heads": int(m.cfg.n_heads)}

    if "model" not in st:                           # nothing else can run without the model
        return _finish(res, args, t_start)
    model, cpu, toks = st["model"], st["cpu"], st["toks"]
    dev = model.W_E.device
    L = int(model.cfg.n_layers)
    layers = [17, 18] if L > 18 else [L - 2, L - 1] if L > 1 else [0]
    recv = "18.6,17.3" if L > 18 else f"{L - 1}.0,{L - 1}.1"
    small = toks[:n_small]
    metric = qk.induction_loss()

    @section("capture", res)
    def _():
        calls = [0]
        original = torch.Tensor.cpu

        def counting(self, *a, **k):
            calls[0] += 1
            return original(self, *a, **k)

        torch.Tensor.cpu = counting
        try:
            acts = qk.capture(model, toks, ["q", "k", "pattern"])
        finally:
            torch.Tensor.cpu = original
        layer = min(3, L - 1)
        x = qk.capture(model, toks, ["q"], layers=[layer])
        normed = {}
        with torch.no_grad(), model.hooks(fwd_hooks=[(f"blocks.{layer}.ln1.hook_normalized",
                                                      lambda t, hook: normed.setdefault("x", t.detach()))]):
            model(toks)
        q_hand = torch.einsum("bpm,hmd->bphd", normed["x"], model.blocks[layer].attn.W_Q.detach())
        return {"cpu_calls": calls[0], "q_max_abs_diff": float((q_hand - x["q", layer]).abs().max()),
                "pattern_device": str(acts["pattern", 0].device), "ok": calls[0] == 0}

    @section("scan", res)
    def _():
        scores = qk.scan(model, progress=False, n_seqs=4 if args.quick else 8)
        top = [str(h) for h, _ in scores.top(5, "induction")]
        out = {"top_induction": top}
        if args.model.startswith("smollm2"):
            out["top3_as_on_cpu"] = top[:3] == SMOLLM2_TOP_INDUCTION
        return out

    @section("sweep", res)
    def _():
        ours = qk.sweep(model, small, metric, layers=layers, progress=False)
        naive = naive_sweep(model, small, metric, layers=layers)
        ref = ours if cpu is model else qk.sweep(cpu, small.cpu(), metric, layers=layers, progress=False)
        d_naive = _max_diff(ours.effects[layers], naive[layers])
        return {"layers": layers, "vs_naive_max_abs_diff_nats": d_naive,
                "vs_cpu_max_abs_diff_nats": _max_diff(ours.effects[layers], ref.effects[layers]),
                "ok": d_naive <= 1e-4}

    got: Dict[str, object] = {}

    @section("path_patch", res)
    def _():
        ours = qk.path_patch(model, recv, into=("k",), tokens=small, progress=False)
        ref = ours if cpu is model else qk.path_patch(cpu, recv, into=("k",), tokens=small.cpu(), progress=False)
        got["exact"] = ours
        return {"receivers": recv, "edges": int((~ours.effects["k"].isnan()).sum()),
                "max_abs_diff_vs_cpu": _max_diff(ours.effects["k"], ref.effects["k"]),
                "effect_scale": float(ref.effects["k"].nan_to_num().abs().max())}

    @section("edge_attribution", res)
    def _():
        ours = qk.edge_attribution(model, recv, into=("k",), tokens=small)
        ref = ours if cpu is model else qk.edge_attribution(cpu, recv, into=("k",), tokens=small.cpu())
        out = {"max_abs_diff_vs_cpu": _max_diff(ours.effects["k"], ref.effects["k"]),
               "effect_scale": float(ref.effects["k"].nan_to_num().abs().max())}
        if "exact" in got:
            out["spearman_vs_exact"] = _rho(got["exact"].effects["k"], ours.effects["k"])
        return out

    @section("task_circuits", res)
    def _():
        task, kind = _task(model, n_task)
        eap = qk.edge_scores(model, task, method="eap", progress=False)
        if cpu is model:
            ref = eap
        else:
            ref = qk.edge_scores(cpu, _task(cpu, n_task)[0], method="eap", progress=False)
        ig = qk.edge_scores(model, task, method="eap-ig", steps=5, progress=False)
        faith = qk.faithfulness(model, task, ig, sizes=(1, 10, 100), progress=False)
        full = float(faith.curve[100.0])
        top_dev, top_cpu = [e[:3] for e in eap.top(10)], [e[:3] for e in ref.top(10)]
        return {"task": kind, "n": task.n, "edges": int(eap.graph.valid.sum()), "clean": float(eap.clean),
                "corrupt": float(eap.corrupt),
                "eap_max_abs_diff_vs_cpu": _max_diff(eap.scores, ref.scores),
                "eap_score_scale": float(ref.scores.nan_to_num().abs().max()),
                "eap_top10_same_as_cpu": sum(a == b for a, b in zip(top_dev, top_cpu)),
                "eap_vs_eap_ig_spearman": _rho(eap.scores, ig.scores),
                "faithfulness": {str(k): float(v) for k, v in faith.curve.items()},
                "chosen_percent": float(faith.chosen_percent), "ok": abs(full - 1.0) <= 1e-3}

    @section("mla", res)
    def _():
        return _mla_check(dev, tmp)

    return _finish(res, args, t_start)


def _mla_check(dev: torch.device, tmp: Path) -> dict:
    """A tiny random DeepSeek-V3 (MLA attention): patterns, path patching and EAP on ``dev`` vs the CPU."""
    folder = tmp / "deepseek-v3"
    _tiny().tiny_deepseek(folder, version=3)
    on_dev = qk.load(str(folder), device=str(dev), verbose=False)
    on_cpu = on_dev if dev.type == "cpu" else qk.load(str(folder), device="cpu", verbose=False)
    L = int(on_cpu.cfg.n_layers)
    toks = qk.repeated_tokens(on_cpu, 2, 10, seed=0)
    a = qk.capture(on_dev, toks.to(dev), ["pattern"])
    b = qk.capture(on_cpu, toks, ["pattern"])
    out: dict = {"layers": L, "pattern_max_abs_diff_vs_cpu": max(_max_diff(a["pattern", l], b["pattern", l])
                                                                 for l in range(L))}
    recv = f"{L - 1}.0"
    pp = qk.path_patch(on_dev, recv, into=("k", "v"), tokens=toks.to(dev), progress=False)
    pp_cpu = pp if on_cpu is on_dev else qk.path_patch(on_cpu, recv, into=("k", "v"), tokens=toks, progress=False)
    out["path_patch_max_abs_diff_vs_cpu"] = max(_max_diff(pp.effects[x], pp_cpu.effects[x]) for x in ("k", "v"))
    task = qk.tasks.induction(on_cpu, n=4, seg_len=6)
    eap = qk.edge_scores(on_dev, task, method="eap", progress=False)
    eap_cpu = eap if on_cpu is on_dev else qk.edge_scores(on_cpu, task, method="eap", progress=False)
    out["eap_max_abs_diff_vs_cpu"] = _max_diff(eap.scores, eap_cpu.scores)
    out["eap_score_scale"] = float(eap_cpu.scores.nan_to_num().abs().max())
    return out


def _finish(res: dict, args, t_start: float) -> dict:
    res["total_seconds"] = round(time.perf_counter() - t_start, 1)
    dev = res["sections"].get("load", {})
    if torch.cuda.is_available() and isinstance(dev, dict) and str(dev.get("device", "")).startswith("cuda"):
        res["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    res["errors"] = sorted(k for k, v in res["sections"].items() if not isinstance(v, dict))
    res["failed_checks"] = sorted(k for k, v in res["sections"].items() if isinstance(v, dict) and v.get("ok") is False)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    print(f"total {res['total_seconds']} s; errors: {res['errors'] or 'none'}; failed checks: "
          f"{res['failed_checks'] or 'none'}" + (f"; wrote {args.out}" if args.out else ""), flush=True)
    return res


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help=f"a qk.load spec, or {TINY!r} (tests/_tiny.py)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="fewer prompts (a CPU run); the GPU sizes are the default")
    ap.add_argument("--out", default=None, help="where to write the JSON")
    args = ap.parse_args(argv)
    res = run(args)
    return 1 if res["errors"] or res["failed_checks"] else 0


if __name__ == "__main__":
    sys.exit(main())
