"""The one prepared script for a GPU session: load, capture, scan, a sweep slice, with timings.

    python scripts/gpu_check.py --device cuda --out gpu_check.json     # on the lent GPU machine
    python scripts/gpu_check.py --device cpu                           # the same checks on the CPU

Checks (each prints a line and lands in the JSON): the model and every tensor stay on the device
(no hidden .cpu() round trips: Tensor.cpu is counted during the hot paths); captured q/k equal the
projections of the normalised residual; scan finds the same top induction heads as on the CPU
(18.6, 17.3, 17.4 on SmolLM2); a sweep over two layers equals the naive loop to 1e-4 nats.
Since issue 19 also, each in its own guarded section (a failure or a missing API is recorded in the JSON
under "sections" as "error: ..." or "skipped: not available", and the next section still runs):
exact path patching and edge attribution of a few receivers against the same computation on the CPU
and against each other; the batched sweep against the CPU's effects; the task circuits
(``qk.edge_scores``, ``qk.faithfulness``, once they exist); and MLA: a tiny random DeepSeek-V3 built here
from ``transformers.DeepseekV3Config`` (patterns on the device vs the CPU). Budget: <= 5 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import qkcircuits as qk
from qkcircuits._analysis.sweep import naive_sweep


def timed(label, fn, results):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    results["seconds"][label] = round(time.perf_counter() - t0, 3)
    print(f"{label:<28} {results['seconds'][label]:8.3f} s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = {"seconds": {}, "checks": {}, "torch": torch.__version__, "python": platform.python_version()}
    model = timed("load", lambda: qk.load(args.model, device=args.device), res)
    dev = model.W_E.device
    res["device"] = str(dev) + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "")
    toks = qk.repeated_tokens(model, 8, 40, seed=0)

    cpu_calls = [0]
    original_cpu = torch.Tensor.cpu

    def counting_cpu(self, *a, **k):
        cpu_calls[0] += 1
        return original_cpu(self, *a, **k)

    torch.Tensor.cpu = counting_cpu
    try:
        acts = timed("capture q,k,pattern (all)", lambda: qk.capture(model, toks, ["q", "k", "pattern"]), res)
        res["checks"]["cpu_calls_in_capture"] = cpu_calls[0]
    finally:
        torch.Tensor.cpu = original_cpu
    x = qk.capture(model, toks, ["q"], layers=[3])  # q of layer 3 from its own normalised input
    normed = {}
    with torch.no_grad(), model.hooks(fwd_hooks=[("blocks.3.ln1.hook_normalized",
                                                  lambda t, hook: normed.setdefault("x", t.detach()))]):
        model(toks)
    q_hand = torch.einsum("bpm,hmd->bphd", normed["x"], model.blocks[3].attn.W_Q.detach())
    res["checks"]["q_max_abs_diff"] = float((q_hand - x["q", 3]).abs().max())
    res["checks"]["pattern_device"] = str(acts["pattern", 0].device)

    scores = timed("scan (6 scores)", lambda: qk.scan(model, progress=False), res)
    res["checks"]["top_induction"] = [str(h) for h, _ in scores.top(5, "induction")]
    metric = qk.induction_loss()
    layers = [17, 18] if model.cfg.n_layers > 18 else [0]
    effects = timed("sweep 2 layers", lambda: qk.sweep(model, toks[:4], metric, layers=layers, progress=False), res)
    naive = naive_sweep(model, toks[:4], metric, layers=layers)
    res["checks"]["sweep_vs_naive_max_diff"] = float((effects.effects[layers] - naive[layers]).abs().max())
    extra_sections(model, args, res, toks, metric, layers)
    if dev.type == "cuda":
        res["checks"]["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated(dev) / 2**20, 1)
    print(json.dumps(res["checks"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


def section(name, res):
    """Run one guarded check: its dict lands in res["sections"][name]; errors are recorded, not raised."""
    def wrap(fn):
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001  (the script must run to the end and write its JSON)
            out = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        if isinstance(out, dict):
            out["seconds"] = round(time.perf_counter() - t0, 3)
        res.setdefault("sections", {})[name] = out
        print(f"{name:<28} {json.dumps(out)[:300]}", flush=True)
        return out
    return wrap


def _max_diff(a, b):
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    keep = ~(a.isnan() | b.isnan())
    return float((a[keep] - b[keep]).abs().max()) if bool(keep.any()) else 0.0


def extra_sections(model, args, res, toks, metric, layers):
    from qkcircuits._foundation.stats import spearman

    dev = model.W_E.device
    cpu = model if dev.type == "cpu" else qk.load(args.model, device="cpu", verbose=False)
    L, H = int(model.cfg.n_layers), int(model.cfg.n_heads)
    recv = "18.6,17.3" if L > 18 else f"{L - 1}.0"
    small = toks[:4]
    got = {}

    @section("path_patch", res)
    def _():
        ours = qk.path_patch(model, recv, into=("k",), tokens=small, progress=False)
        ref = qk.path_patch(cpu, recv, into=("k",), tokens=small.cpu(), progress=False)
        got["exact"] = ours
        return {"receivers": recv, "max_abs_diff_vs_cpu": _max_diff(ours.effects["k"], ref.effects["k"]),
                "effect_scale": float(ref.effects["k"].nan_to_num().abs().max())}

    @section("edge_attribution", res)
    def _():
        ours = qk.edge_attribution(model, recv, into=("k",), tokens=small)
        ref = qk.edge_attribution(cpu, recv, into=("k",), tokens=small.cpu())
        out = {"max_abs_diff_vs_cpu": _max_diff(ours.effects["k"], ref.effects["k"])}
        if "exact" in got:
            e, a = got["exact"].effects["k"].float().cpu(), ours.effects["k"].float().cpu()
            keep = ~(e.isnan() | a.isnan())
            out["spearman_vs_exact"] = float(spearman(e[keep], a[keep]))
        return out

    @section("batched_sweep_vs_cpu", res)
    def _():
        ours = qk.sweep(model, small, metric, layers=layers, progress=False)
        ref = qk.sweep(cpu, small.cpu(), metric, layers=layers, progress=False)
        return {"layers": layers, "max_abs_diff_nats": _max_diff(ours.effects[layers], ref.effects[layers])}

    @section("task_circuits", res)
    def _():
        if not (hasattr(qk, "edge_scores") and hasattr(qk, "faithfulness")):
            return "skipped: not available (qk.edge_scores / qk.faithfulness are not in this qkcircuits)"
        scores = qk.edge_scores(model, "ioi")
        faith = qk.faithfulness(model, scores)
        return {"edge_scores": type(scores).__name__, "faithfulness": str(faith)[:200]}

    @section("mla_deepseek_v3", res)
    def _():
        return _mla_check(dev)


def _mla_check(dev):
    """A tiny random DeepSeek-V3 (MLA attention) built from its config: patterns on ``dev`` vs the CPU."""
    import sys
    import tempfile
    from pathlib import Path

    try:
        from transformers import AutoModelForCausalLM, DeepseekV3Config
    except ImportError:
        return "skipped: not available (transformers has no DeepseekV3Config)"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from _tiny import bpe_tokenizer

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=400, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                           kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                           n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                           n_group=1, topk_group=1, max_position_embeddings=128, architectures=["DeepseekV3ForCausalLM"])
    with tempfile.TemporaryDirectory() as tmp:
        AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp)
        bpe_tokenizer().save_pretrained(tmp)
        on_dev = qk.load(tmp, device=str(dev), verbose=False)
        on_cpu = qk.load(tmp, device="cpu", verbose=False)
        toks = qk.repeated_tokens(on_cpu, 2, 10, seed=0)
        a = qk.capture(on_dev, toks.to(dev), ["pattern"])
        b = qk.capture(on_cpu, toks, ["pattern"])
        return {"layers": 2, "pattern_max_abs_diff_vs_cpu": max(_max_diff(a["pattern", l], b["pattern", l])
                                                               for l in range(2))}


if __name__ == "__main__":
    main()
