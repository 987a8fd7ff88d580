"""Memory of a loaded model: ``qk.load`` against a plain transformers load of the same checkpoint.

    .venv/bin/python benchmarks/bench_memory.py [--model smollm2-135m] [--device cpu]

Each configuration runs in a FRESH subprocess (resident memory never goes back down inside one
process, so configurations measured one after another would pollute each other). Reported per
configuration, from /proc/self/status: resident set (VmRSS) after the load, peak resident set
(VmHWM) over the whole process, and the same two numbers for the process right after its imports
(what the libraries alone cost: transformers for the plain load; transformers and TransformerLens's
model bridge for ``qk.load``, which imports it on its first call since ``import qkcircuits`` stays light;
for ``qk.load`` also the resident set before TransformerLens's import, after ``import qkcircuits`` and the same
transformers classes as the plain load),
the bytes held by the model's parameters and buffers, and the bytes of every other live tensor (caches
on the model, reader buffers: 0 when nothing but the model's own tensors stays); on a GPU also
torch.cuda.memory_allocated / max_memory_allocated. Ratios are against the plain load: of the whole
process (steady, peak), of the load alone (steady minus the imports) and, for ``qk.load``, of the load with
TransformerLens's import counted in it (steady minus the resident set before that import).
"Steady" is read after every parameter and buffer was summed once: a load from qkcircuits' GGUF cache maps its
folded weights from a safetensors file, whose pages count only once read (right after the load the resident
set was below the weights' own bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CONFIGS = {
    # name: (loader, kwargs)
    "plain transformers (fp32)": ("plain", {"dtype": "float32"}),
    "qk.load fold_ln=True (fp32)": ("qk", {"dtype": "float32", "fold_ln": True}),
    "qk.load fold_ln=False (fp32)": ("qk", {"dtype": "float32", "fold_ln": False}),
    "qk.load fold_ln=True, lean=False (fp32, before this change)": ("qk", {"dtype": "float32", "fold_ln": True,
                                                                           "lean": False}),
    "plain transformers (bf16)": ("plain", {"dtype": "bfloat16"}),
    "qk.load fold_ln=True (bf16)": ("qk", {"dtype": "bfloat16", "fold_ln": True}),
}

CHILD = r"""
import gc, json, os, sys, torch
torch.set_num_threads(1)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
def status():
    d = {}
    for line in open("/proc/self/status"):
        k = line.split(":")[0]
        if k in ("VmRSS", "VmHWM"):
            d[k] = int(line.split()[1]) * 1024
    return d
loader, model_spec, device, kw = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
dtype = getattr(torch, kw.pop("dtype"))
if loader == "plain":
    from transformers import AutoModelForCausalLM, AutoTokenizer
    before = status()
    from pathlib import Path
    path = Path(kw.pop("gguf")) if "gguf" in kw else None     # not importing qkcircuits: that imports TransformerLens
    if path is not None:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).to(device)
    else:
        tok = AutoTokenizer.from_pretrained(model_spec)
        model = AutoModelForCausalLM.from_pretrained(model_spec, dtype=dtype).to(device)
    model.eval()
else:
    import qkcircuits as qk
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401  (as the plain load's imports)
    pre_tl = status()
    import transformer_lens.model_bridge  # noqa: F401  (qk.load's first call imports it: a library cost, not the load's)
    before = status()
    model = qk.load(model_spec, device=device, dtype=dtype, verbose=False, **kw)
with torch.no_grad():               # read every weight once: memory-mapped ones count only once read
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type != "meta" and t.numel():
            t.sum()
held = {}
for t in list(model.parameters()) + list(model.buffers()):
    held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
after = status()
other = {}
for o in gc.get_objects():          # every other live tensor: caches, reader buffers, a second copy of a weight
    if isinstance(o, torch.Tensor) and o.device.type != "meta":
        s = o.untyped_storage()
        if s.data_ptr() not in held:
            other[s.data_ptr()] = s.nbytes()
out = {"rss": after["VmRSS"], "peak": after["VmHWM"], "rss_imports": before["VmRSS"], "peak_imports": before["VmHWM"],
       "rss_before_tl": (pre_tl if loader != "plain" else before)["VmRSS"],
       "tensors": sum(held.values()), "other_tensors": sum(other.values())}
if device.startswith("cuda"):
    out["cuda"] = torch.cuda.memory_allocated()
    out["cuda_peak"] = torch.cuda.max_memory_allocated()
print("RESULT " + json.dumps(out))
"""


def measure(loader: str, model: str, device: str, kwargs: dict) -> dict:
    if loader == "plain" and model == "smollm2-135m":
        from qkcircuits._foundation.fetch import smollm2_gguf

        kwargs["gguf"] = str(smollm2_gguf(quiet=True))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", CHILD, loader, model, device, json.dumps(kwargs)],
                          capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{loader} {kwargs} failed: {proc.stderr.strip().splitlines()[-1:]}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--only", nargs="*", help="configuration names (substrings) to run")
    args = ap.parse_args()
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"model {args.model}, device {args.device}, load average {' '.join(load)}; GB = 1e9 bytes")
    results = {}
    for name, (loader, kw) in CONFIGS.items():
        if args.only and not any(s in name for s in args.only):
            continue
        results[name] = r = measure(loader, args.model, args.device, dict(kw))
        base = results.get("plain transformers (bf16)" if "bf16" in name else "plain transformers (fp32)")
        plain_load = base["rss"] - base["rss_imports"] if base else 0
        ratio = (f"  x{r['rss'] / base['rss']:.2f} steady, x{r['peak'] / base['peak']:.2f} peak, load alone "
                 f"x{(r['rss'] - r['rss_imports']) / plain_load:.2f}, with TransformerLens's import "
                 f"x{(r['rss'] - r['rss_before_tl']) / plain_load:.2f}") if base else ""
        cuda = (f"  cuda {r['cuda'] / 1e9:.2f} GB (peak {r['cuda_peak'] / 1e9:.2f})" if "cuda" in r else "")
        print(f"{name:<62} steady {r['rss'] / 1e9:5.2f} GB  peak {r['peak'] / 1e9:5.2f} GB  "
              f"(imports {r['rss_imports'] / 1e9:.2f})  tensors {r['tensors'] / 1e9:.2f} GB (+{r['other_tensors'] / 1e9:.2f} "
              f"other){ratio}{cuda}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
