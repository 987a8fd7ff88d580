"""The one prepared script for a GPU session: load, capture, scan, a sweep slice, with timings.

    python scripts/gpu_check.py --device cuda --out gpu_check.json     # on the lent GPU machine
    python scripts/gpu_check.py --device cpu                           # the same checks on the CPU

Checks (each prints a line and lands in the JSON): the model and every tensor stay on the device
(no hidden .cpu() round trips: Tensor.cpu is counted during the hot paths); captured q/k equal the
projections of the normalised residual; scan finds the same top induction heads as on the CPU
(18.6, 17.3, 17.4 on SmolLM2); a sweep over two layers equals the naive loop to 1e-4 nats.
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
    if dev.type == "cuda":
        res["checks"]["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated(dev) / 2**20, 1)
    print(json.dumps(res["checks"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
