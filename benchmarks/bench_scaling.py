"""Cost curves: wall time and peak memory of every analysis as the model and the prompts grow.

    .venv/bin/python benchmarks/bench_scaling.py [--grid sizes,lengths] [--sizes 135m,360m,1b]
        [--dtypes float32,bfloat16] [--lengths 81,161,321,641,1281] [--ops ...] [--n-seqs 4]
        [--timeout 900] [--max-rss 13] [--quick] [--out benchmarks/results]
    .venv/bin/python benchmarks/bench_scaling.py --plot [--out ...]      # PNGs into docs/figures/

Two grids, each configuration in a FRESH subprocess (peak resident memory never goes back down inside
one process), one CPU thread (``torch.set_num_threads(1)``):

- ``sizes``: random-weight Llama-shaped models built locally from ``LlamaConfig`` (``SHAPES``: SmolLM2-135M,
  SmolLM2-360M, and TinyLlama-1.1B's dims with SmolLM2's 49,152-token vocabulary, tied embeddings: ~1.0B),
  saved once as bf16 safetensors with SmolLM2's tokenizer (from its GGUF) under ``--cache``, loaded through
  ``qk.load(folder, dtype=...)``; prompts ``--n-seqs`` × ``--size-length`` tokens.
- ``lengths``: the real SmolLM2-135M (``qk.load("smollm2-135m")``, fp32) on ``--n-seqs`` × L tokens,
  L = 1 + 2 × seg_len ([BOS] + R + R) for each L of ``--lengths``.

Per configuration the child loads the model, builds ONE batch ``qk.repeated_tokens(model, n_seqs, (L-1)/2)``,
times one plain forward of it (``model(tokens)`` without gradients; best of 2 when it is short) and then
each op of ``--ops`` on the same batch, printing one JSON line per op as it finishes (so a configuration
stopped by ``--timeout`` keeps what it measured):

    load              qk.load (peak over the load; ratio to the bytes of the weights)
    forward           the plain forward (the unit of every ratio)
    scan-restricted   qk.scan(scores=induction,previous_token,duplicate_token) on the batch's prompts
    scan-default      qk.scan() default scores (the same [BOS]+R+R prompts, plus its own fixed-size sets)
    sweep             qk.sweep(tokens, layers=[l*]) with l* = round(0.75 (n_layers - 1)): per head
    path-patch        qk.path_patch(every head of l* into k, senders = every earlier head): per edge
    edge-attribution  qk.edge_attribution, same receivers/senders/into: per edge
    eap, eap-ig       qk.edge_scores(qk.tasks.induction(n_seqs, seg_len), method=...) (its own forward too)
    ioi-eap-ig        qk.edge_scores(qk.tasks.ioi(n=n_seqs), "eap-ig"), with the ioi batch's own forward

Memory: before each op the freed heap is handed back (``malloc_trim(0)``) and ``/proc/self/clear_refs`` is
written ``5`` (resets VmHWM), so each op's peak is its own; ``extra`` = peak − resident set before the op. glibc's mmap threshold is pinned (MALLOC_MMAP_THRESHOLD_)
so freed tensors go back to the system between ops. Every record carries os.getloadavg(). Results go to
``--out``/scaling-{sizes,lengths}.json (merged with what is there, keyed by grid/size/dtype/length/op);
``--plot`` reads those JSON files only. A watchdog stops a configuration's process when its resident set
passes ``--max-rss`` GB (default 13: the machine is shared); the ops it had not finished are recorded with
that reason instead of figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"          # scaling-sizes.json, scaling-lengths.json
FIGURES = ROOT / "docs" / "figures"

# LlamaConfig keyword arguments. vocab 49,152 (SmolLM2's tokenizer) for all three.
SHAPES = {
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, rope_theta=100000.0),                                   # SmolLM2-135M
    "360m": dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                 num_key_value_heads=5, rope_theta=100000.0),                                   # SmolLM2-360M
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, rope_theta=10000.0),                        # TinyLlama-1.1B dims
}
ALL_OPS = ("load", "forward", "scan-restricted", "scan-default", "sweep", "path-patch", "edge-attribution",
           "eap", "eap-ig", "ioi-eap-ig")
# What runs by default where (the 1B model and long prompts get the ops that stay within a few forwards).
DEFAULT_OPS = {
    "small": ALL_OPS,
    "1b": ("load", "forward", "scan-restricted", "scan-default", "path-patch", "edge-attribution", "eap"),
    "bfloat16": ("load", "forward", "scan-restricted", "edge-attribution", "eap"),
    "long": ("load", "forward", "scan-restricted", "scan-default", "path-patch", "edge-attribution", "eap"),
}
RESTRICTED = ("induction", "previous_token", "duplicate_token")


# ---------------------------------------------------------------------------------------------- child

def _status() -> dict:
    d = {}
    with open("/proc/self/status") as f:
        for line in f:
            k = line.split(":")[0]
            if k in ("VmRSS", "VmHWM"):
                d[k] = int(line.split()[1]) * 1024
    return d


def _trim() -> None:
    """Give freed heap back to the system (glibc keeps it otherwise: the next op's baseline would include it)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _emit(rec: dict) -> None:
    rec["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    print("RESULT " + json.dumps(rec), flush=True)


def _measure(fn):
    import gc

    gc.collect()
    _trim()
    _reset_peak()
    before = _status()["VmRSS"]
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    peak = _status()["VmHWM"]
    return out, {"wall_s": wall, "cpu_s": cpu, "rss_before": before, "peak": peak, "extra": peak - before}


def build_folder(size: str, cache: Path) -> Path:
    """A random-weight Llama of ``SHAPES[size]`` saved (bf16 safetensors + SmolLM2's tokenizer) once."""
    folder = cache / f"llama-{size}"
    if (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file():
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from qkcircuits._foundation.fetch import smollm2_gguf

    path = smollm2_gguf(quiet=True)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, head_dim=None,
                      **SHAPES[size])
    cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    tmp = folder.with_name(folder.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def child(spec: dict) -> None:
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import qkcircuits as qk

    ops, n = spec["ops"], spec["n_seqs"]
    spec["length"] = spec["lengths"][0]
    dtype = getattr(torch, spec["dtype"])
    key = {k: spec[k] for k in ("grid", "size", "dtype", "length", "n_seqs")}
    target = spec["model"] if spec["model"] == "smollm2-135m" else str(build_folder(spec["size"], Path(spec["cache"])))
    model, m = _measure(lambda: qk.load(target, device="cpu", dtype=dtype, verbose=False))
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in list(model.parameters()) + list(model.buffers())}
    weights = sum(held.values())
    cfg = model.cfg
    n_params = sum(p.numel() for p in model.parameters())
    info = {"n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "d_model": cfg.d_model, "d_vocab": cfg.d_vocab,
            "params": n_params, "weight_bytes": weights}
    if "load" in ops:
        _emit({**key, **info, "op": "load", **m})
    for L in spec["lengths"]:
        key["length"] = L
        ops = spec["ops_by_length"][str(L)]
        seg = (L - 1) // 2
        tokens = qk.repeated_tokens(model, n, seg, 2, seed=0)

        def forward(toks):
            with torch.no_grad():
                return model(toks)

        def fwd_ref(toks):
            _, f = _measure(lambda: forward(toks))
            if f["wall_s"] < 30:                       # best of 2 when cheap
                _, f2 = _measure(lambda: forward(toks))
                f = min(f, f2, key=lambda r: r["cpu_s"]) | {"peak": max(f["peak"], f2["peak"])}
            return f

        fwd = fwd_ref(tokens)
        base = {**key, **info, "tokens": list(tokens.shape), "forward_wall_s": fwd["wall_s"], "forward_cpu_s": fwd["cpu_s"]}
        _emit({**base, "op": "forward", **fwd, "forwards": 1.0, "forwards_cpu": 1.0})
        H, nl = cfg.n_heads, cfg.n_layers
        lstar = round(0.75 * (nl - 1))
        recv = [qk.Head(lstar, h) for h in range(H)]

        def run(op, fn, units=None, unit=None, ref=None, **extra):
            if op not in ops:
                return
            try:
                _, r = _measure(fn)
            except Exception as e:                       # noqa: BLE001  -- record it, go on with the next op
                _emit({**base, "op": op, "error": f"{type(e).__name__}: {e}"[:300]})
                return
            ref = ref or fwd
            rec = {**base, "op": op, **r, "forwards": r["wall_s"] / ref["wall_s"],
                   "forwards_cpu": r["cpu_s"] / ref["cpu_s"], **extra}
            if ref is not fwd:
                rec.update(forward_wall_s=ref["wall_s"], forward_cpu_s=ref["cpu_s"], forward_peak=ref["peak"])
            if units:
                rec.update(units=units, unit=unit, per_unit_s=r["wall_s"] / units, per_unit_cpu_s=r["cpu_s"] / units,
                           per_unit_forwards=r["cpu_s"] / units / ref["cpu_s"])
            _emit(rec)

        run("scan-restricted", lambda: qk.scan(model, scores=RESTRICTED, n_seqs=n, seg_len=seg, progress=False))
        run("scan-default", lambda: qk.scan(model, n_seqs=n, seg_len=seg, progress=False))
        run("sweep", lambda: qk.sweep(model, tokens, layers=[lstar], progress=False), units=H, unit="head",
            layer=lstar)
        n_edges = lstar * H * H
        run("path-patch", lambda: qk.path_patch(model, recv, into=("k",), tokens=tokens, progress=False),
            units=n_edges, unit="edge", layer=lstar)
        run("edge-attribution", lambda: qk.edge_attribution(model, recv, into=("k",), tokens=tokens),
            units=n_edges, unit="edge", layer=lstar)
        if any(o in ops for o in ("eap", "eap-ig")):
            task = qk.tasks.induction(model, n=n, seg_len=seg)
            g = qk.graph(model)
            tref = fwd_ref(task.clean)
            for method in ("eap", "eap-ig"):
                run(method, lambda: qk.edge_scores(model, task, method=method, progress=False), units=g.n_edges,
                    unit="edge", ref=tref, task="induction", task_tokens=list(task.clean.shape))
        if "ioi-eap-ig" in ops:
            task = qk.tasks.ioi(model, n=n)
            g = qk.graph(model)
            tref = fwd_ref(task.clean)
            run("ioi-eap-ig", lambda: qk.edge_scores(model, task, method="eap-ig", progress=False), units=g.n_edges,
                unit="edge", ref=tref, task="ioi", task_tokens=list(task.clean.shape))


# --------------------------------------------------------------------------------------------- parent

def run_config(spec: dict, timeout: float, save=lambda recs: None, max_rss: float = 0) -> list:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(4 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 20),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    recs, t0 = [], time.perf_counter()
    errlog = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench_scaling.{os.getpid()}.err"), "w+")
    proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], stdout=subprocess.PIPE,
                            stderr=errlog, text=True, env=env)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    over = []                                    # the child's RSS when the watchdog stopped it

    def watch():                                 # --max-rss: stop the child before it crowds the machine
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    rss = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS"))
            except (OSError, StopIteration, ValueError):
                return
            if max_rss and rss > max_rss:
                over.append(rss)
                proc.kill()
                return
            time.sleep(0.1)

    threading.Thread(target=watch, daemon=True).start()
    for line in proc.stdout:                     # records stream in as each op finishes
        if line.startswith("RESULT "):
            recs.append(json.loads(line[7:]))
            _show(recs[-1])
            save(recs)                           # on disk at once: a stopped run keeps what it measured
    proc.wait()
    timer.cancel()
    errlog.seek(0)
    err = errlog.read() + (f"\n(stopped: resident memory {over[0] / 1e9:.1f} GB > --max-rss {max_rss / 1e9:.1f} GB)"
                           if over else
                           f"\n(stopped after {timeout:.0f} s)" if time.perf_counter() - t0 >= timeout else
                           f"\nprocess ended by signal {-proc.returncode}" if proc.returncode < 0 else "")
    errlog.close()
    done = {(r["length"], r["op"]) for r in recs}
    for L in spec["lengths"]:
        for op in spec["ops_by_length"][str(L)]:
            if (L, op) not in done and not (op == "load" and L != spec["lengths"][0]):
                recs.append({**{k: spec[k] for k in ("grid", "size", "dtype", "n_seqs")}, "length": L, "op": op,
                             "error": (err.strip().splitlines() or ["?"])[-1][:300]})
    print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return recs


def _key(r: dict) -> str:
    return "/".join(str(r[k]) for k in ("grid", "size", "dtype", "length", "n_seqs", "op"))


def _show(r: dict) -> None:
    if "error" in r:
        print(f"    {r['op']:<17} not measured: {r['error']}", flush=True)
        return
    per = f"  {r['per_unit_cpu_s'] * 1e3:8.2f} ms CPU/{r['unit']}" if "per_unit_s" in r else ""
    x = f"  {r['forwards_cpu']:7.2f} fwd" if "forwards_cpu" in r else ""
    print(f"    {r['length']:>5} {r['op']:<17} {r['wall_s']:8.2f} s wall {r['cpu_s']:8.2f} s CPU{x}{per}  "
          f"peak {r['peak'] / 1e9:5.2f} GB "
          f"(+{r['extra'] / 1e9:5.2f})  load {r['loadavg'][0]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--plot", action="store_true", help="only draw the PNGs from --out")
    ap.add_argument("--table", action="store_true", help="only print the markdown tables and fits from --out")
    ap.add_argument("--grid", default="sizes,lengths")
    ap.add_argument("--sizes", default="135m,360m,1b")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--lengths", default="81,161,321,641,1281")
    ap.add_argument("--size-length", type=int, default=81, help="prompt length of the sizes grid")
    ap.add_argument("--ops", default=None, help=f"comma-separated subset of {','.join(ALL_OPS)} (default: per "
                    "configuration, see DEFAULT_OPS)")
    ap.add_argument("--n-seqs", type=int, default=4)
    ap.add_argument("--length-seqs", type=int, default=2, help="prompts per batch of the lengths grid")
    ap.add_argument("--long-from", type=int, default=641, help="lengths from here on run DEFAULT_OPS['long']")
    ap.add_argument("--long-ops", default=None, help="ops of the lengths >= --long-from (default DEFAULT_OPS['long'])")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per configuration (one subprocess)")
    ap.add_argument("--max-rss", type=float, default=13.0, help="GB of resident memory at which a configuration's "
                    "process is stopped (its unfinished ops are recorded as not measured; 0: no limit)")
    ap.add_argument("--quick", action="store_true", help="135m only, lengths 81,161, forward + restricted scan")
    ap.add_argument("--cache", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "qk-scaling"))
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return 0
    if args.plot:
        return plot(Path(args.out))
    if args.table:
        return table(Path(args.out))
    if args.quick:
        args.sizes, args.lengths, args.ops, args.dtypes = "135m", "81,161", "load,forward,scan-restricted", "float32"
    ops = [o for o in args.ops.split(",")] if args.ops else None
    for o in (ops or []) + (args.long_ops.split(",") if args.long_ops else []):
        if o not in ALL_OPS:
            print(f"error: unknown op {o!r}; use {', '.join(ALL_OPS)}", file=sys.stderr)
            return 2
    specs = []
    if "sizes" in args.grid:
        for dt in args.dtypes.split(","):
            for s in args.sizes.split(","):
                default = DEFAULT_OPS["bfloat16" if dt == "bfloat16" else "1b" if s == "1b" else "small"]
                o = ops or list(default)
                specs.append(dict(grid="sizes", size=s, model=f"llama-{s}", dtype=dt, lengths=[args.size_length],
                                  n_seqs=args.n_seqs, ops=o, ops_by_length={str(args.size_length): o},
                                  cache=args.cache))
    if "lengths" in args.grid:
        # ONE process for all lengths (SmolLM2's GGUF load is the slow part); each op's peak is its own
        # (clear_refs), so the memory figures stay per op.
        lengths = [int(x) for x in args.lengths.split(",")]
        long_ops = args.long_ops.split(",") if args.long_ops else None
        by = {str(L): (long_ops or ops or list(DEFAULT_OPS["long"])) if L >= args.long_from else
              (ops or [o for o in DEFAULT_OPS["small"] if o not in ("ioi-eap-ig", "eap-ig" if L > 161 else "")])
              for L in lengths}
        specs.append(dict(grid="lengths", size="135m", model="smollm2-135m", dtype="float32", lengths=lengths,
                          n_seqs=args.length_seqs or args.n_seqs, ops=sorted({o for v in by.values() for o in v}),
                          ops_by_length=by, cache=args.cache))
    for spec in specs:
        out = Path(args.out) / f"scaling-{spec['grid']}.json"

        def save(recs, out=out):
            data = json.loads(out.read_text()) if out.is_file() else {"records": {}}
            data["machine"] = f"{os.cpu_count()} CPUs, torch.set_num_threads(1); Linux {os.uname()[2]}"
            for r in recs:
                data["records"][_key(r)] = r
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(data, indent=1, sort_keys=True))

        print(f"{spec['grid']}: {spec['model']} {spec['dtype']} {spec['n_seqs']} x {spec['lengths']} tokens; "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)
        recs = run_config(spec, args.timeout * len(spec["lengths"]), save, max_rss=args.max_rss * 1e9)
        for r in recs:
            if "error" in r:
                _show(r)
        save(recs)
        print(f"wrote {out}")
    return 0


# ------------------------------------------------------------------------------------- tables, plot

def _records(path: Path) -> list:
    return [r for f in sorted(path.glob("scaling-*.json")) for r in json.loads(f.read_text())["records"].values()
            if "error" not in r]


def hf_params(size: str, vocab: int = 49152) -> int:
    """Parameters of the Hugging Face checkpoint of ``SHAPES[size]`` (tied embeddings counted once)."""
    c = SHAPES[size]
    d, f, L, H, kv = (c[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                     "num_key_value_heads"))
    dh = d // H
    return L * (2 * d * H * dh + 2 * d * kv * dh + 3 * d * f + 2 * d) + vocab * d + d


def _slope(xs, ys) -> float:
    """Least-squares slope of log y on log x (the exponent of a power law)."""
    import math

    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def _lin_quad(ls, ys):
    """Least squares y = c + a L + b L^2 with c, a, b >= 0; returns c, a, b.

    The constant is the fixed cost (the default scan's own prompt sets, EAP's per-call work): without it
    such an op's fit came out with b < 0 (an "L² share" of -99 %). Non-negative by trying each subset of the
    three terms and keeping the best fit with no negative coefficient."""
    import itertools

    import numpy as np

    X = np.array([[1.0, L, L * L] for L in ls])
    y = np.array(ys, dtype=float)
    best = None
    for k in (3, 2, 1):
        for cols in itertools.combinations(range(3), k):
            coef, *_ = np.linalg.lstsq(X[:, cols], y, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(3)
            full[list(cols)] = coef
            err = float(((X @ full - y) ** 2).sum())
            if best is None or err < best[0] - 1e-12:
                best = (err, full)
    c, a, b = best[1]
    return float(c), float(a), float(b)


def table(path: Path) -> int:
    recs = _records(path)
    get = {(r["grid"], r["size"], r["dtype"], r["length"], r["op"]): r for r in recs}
    loads = sorted({r["loadavg"][0] for r in recs})
    print(f"load average (1 min) over the records: {loads[0]}-{loads[-1]}" if loads else "no records")
    for dt in ("float32", "bfloat16"):
        lens = [r["length"] for r in recs if r["grid"] == "sizes" and r["dtype"] == dt and r["op"] == "forward"]
        if not lens:
            continue
        S = max(set(lens), key=lens.count)
        sizes = [s for s in SHAPES if ("sizes", s, dt, S, "forward") in get]
        if not sizes:
            continue
        print(f"\n### sizes, {dt}, {get[('sizes', sizes[0], dt, S, 'forward')]['tokens']} tokens\n")
        print("| op | " + " | ".join(f"{s} ({hf_params(s) / 1e6:.0f} M)"
                                    for s in sizes) + " | exponent in params (CPU s) |")
        print("|---" * (len(sizes) + 2) + "|")
        for op in ALL_OPS:
            rs = [get.get(("sizes", s, dt, S, op)) for s in sizes]
            if not any(rs):
                continue
            cells = []
            for r in rs:
                if r is None:
                    cells.append("–")
                    continue
                x = f", {r['forwards_cpu']:.2f}×" if op not in ("load", "forward") else ""
                cells.append(f"{r['cpu_s']:.1f} s{x}; peak {r['peak'] / 1e9:.2f} GB (+{r['extra'] / 1e9:.2f})")
            ok = [(hf_params(r["size"]), r["cpu_s"]) for r in rs if r]
            exp = f"{_slope(*zip(*ok)):.2f}" if len(ok) >= 2 else "–"
            print(f"| {op} | " + " | ".join(cells) + f" | {exp} |")
    ls = sorted({r["length"] for r in recs if r["grid"] == "lengths" and r["op"] == "forward"})
    if ls:
        print(f"\n### lengths, SmolLM2-135M fp32, {get[('lengths', '135m', 'float32', ls[0], 'forward')]['n_seqs']}"
              " prompts\n")
        print("| op | " + " | ".join(str(L) for L in ls) + " | fit CPU s = c + a L + b L² (c, a, b ≥ 0): L² share "
              "at the last L; L where b L² = a L | exponent last two L | extra memory exponent |")
        print("|---" * (len(ls) + 4) + "|")
        for op in ALL_OPS:
            rs = [get.get(("lengths", "135m", "float32", L, op)) for L in ls]
            if op == "load" or not any(rs):
                continue
            cells = ["–" if r is None else
                     f"{r['cpu_s']:.1f} s" + ("" if op == "forward" else f", {r['forwards_cpu']:.2f}×") +
                     f"; +{r['extra'] / 1e6:.0f} MB" for r in rs]
            ok = [(L, r) for L, r in zip(ls, rs) if r]
            fit = slope2 = mem = "–"
            if len(ok) >= 3:
                c, a, b = _lin_quad([L for L, _ in ok], [r["cpu_s"] for _, r in ok])
                Lm = ok[-1][0]
                cross = f"{a / b:.0f}" if b > 0 and a > 0 else "–"
                fit = (f"c={c:.2g}, a={a:.2e}, b={b:.2e}: {b * Lm ** 2 / (c + a * Lm + b * Lm ** 2):.0%}; "
                       f"{cross}")
                pos = [(L, r["extra"]) for L, r in ok if r["extra"] > 1e6]
                mem = f"{_slope(*zip(*pos)):.2f}" if len(pos) >= 2 else "–"
            if len(ok) >= 2:
                slope2 = f"{_slope([ok[-2][0], ok[-1][0]], [ok[-2][1]['cpu_s'], ok[-1][1]['cpu_s']]):.2f}"
            print(f"| {op} | " + " | ".join(cells) + f" | {fit} | {slope2} | {mem} |")
    return 0


# ----------------------------------------------------------------------------------------------- plot

def plot(path: Path) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = _records(path)
    FIGURES.mkdir(parents=True, exist_ok=True)
    ops = [o for o in ALL_OPS if o != "load"]
    for r in recs:
        r["hf_params"] = hf_params(r["size"])
    for grid, xname, xlabel in (("sizes", "hf_params", "parameters (checkpoint)"),
                                ("lengths", "length", "prompt length (tokens)")):
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
        for dt, style in (("float32", "-o"), ("bfloat16", "--s")):
            for op in ops:
                pts = sorted((r[xname], r) for r in recs if r["grid"] == grid and r["dtype"] == dt and r["op"] == op)
                if len(pts) < 2:
                    continue
                xs = [p for p, _ in pts]
                lab = f"{op} ({'bf16' if dt == 'bfloat16' else 'fp32'})"
                axes[0].plot(xs, [r["cpu_s"] for _, r in pts], style, label=lab, ms=4)
                axes[1].plot(xs, [r.get("forwards_cpu", r.get("forwards")) for _, r in pts], style, label=lab, ms=4)
                # lengths: the op's own memory; records from before malloc_trim whose "+" is ~0 are left out
                mp = [(x, r["peak"] if grid == "sizes" else r["extra"]) for x, (_, r) in zip(xs, pts)]
                mp = [(x, v / 1e9) for x, v in mp if grid == "sizes" or v > 5e6]
                axes[2].plot([x for x, _ in mp], [v for _, v in mp], style, label=lab, ms=4)
            w = sorted((r[xname], r["weight_bytes"] / 1e9) for r in recs
                       if r["grid"] == grid and r["dtype"] == dt and r["op"] == "forward" and "weight_bytes" in r)
            if len(w) >= 2 and grid == "sizes":
                axes[2].plot([a for a, _ in w], [b for _, b in w], ":k" if dt == "float32" else ":",
                             label=f"weights ({dt})", lw=2)
        mem_title = "peak RSS during the op (GB); dotted: weights" if grid == "sizes" else \
            "memory above the RSS before the op (GB)"
        for ax, title in zip(axes, ("CPU seconds (one thread)", "CPU time in plain forwards of the same batch",
                                    mem_title)):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
        if axes[1].get_legend_handles_labels()[0]:
            axes[1].legend(fontsize=7, ncol=2)
        la = sorted(r["loadavg"][0] for r in recs if r["grid"] == grid)
        fig.suptitle(f"qkcircuits cost curves ({grid}; one CPU thread, load average {la[0]:.1f}-{la[-1]:.1f} "
                     "on the machine's 2 cores: see docs/benchmarks.md)" if la else f"qkcircuits cost curves ({grid})")
        fig.tight_layout()
        dst = FIGURES / f"scaling-{grid}.png"
        fig.savefig(dst, dpi=110)
        plt.close(fig)
        print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
