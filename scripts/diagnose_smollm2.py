"""Reproduce the √d_k argument on a real model: the numbers and plots of docs/diagnostics.md.

    python scripts/diagnose_smollm2.py                       # SmolLM2-135M, tables to stdout
    python scripts/diagnose_smollm2.py --png docs/diagnostics --json /tmp/smollm2_diagnose.json

Prints markdown tables (per layer: Var(q·k)/d_k, what independence predicts, saturation with and
without scaling, entropy, sinks; then the flagged heads). With ``--png DIR`` it also writes small
PNG plots, which needs ``kaleido`` (``pip install kaleido``; it drives a local Chrome/Chromium,
e.g. Debian's ``chromium``). One streamed pass per prompt set; ~1 min on one CPU thread.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

import qkcircuits as qk


def layer_table(d) -> str:
    def m(name, s=None):                                   # mean over heads, pooled or one prompt set
        return (d.by_set[s][name] if s else d[name]).nanmean(1)

    rows = ["| layer | scale | Var(q·k)/d_k mean (min–max over heads) | text | repeated | no first key | "
            "Σ Var(q_d)Var(k_d) / d_k | indep. components / d_k | q ⟂ k / d_k | measured / (q ⟂ k) | "
            "Var(q_d) | Var(k_d) | scaled var |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    r = d["qk_var_ratio"]
    for L in range(d.n_layers):
        rows.append(
            f"| {L} | {float(d.scale[L]):.4g} | {float(m('qk_var_ratio')[L]):.2f} "
            f"({float(r[L].min()):.2f}–{float(r[L].max()):.2f}) | {float(m('qk_var_ratio', 'text')[L]):.2f} | "
            f"{float(m('qk_var_ratio', 'repeated')[L]):.2f} | {float(m('qk_var_no_first')[L]) / d.d_head:.2f} | "
            f"{float(m('pred_var_zero_mean')[L]) / d.d_head:.2f} | "
            f"{float(m('pred_var_components')[L]) / d.d_head:.2f} | {float(m('pred_var_indep')[L]) / d.d_head:.2f} | "
            f"{float(m('indep_ratio')[L]):.2f} | {float(m('q_var')[L]):.2f} | {float(m('k_var')[L]):.2f} | "
            f"{float(m('scaled_var')[L]):.2f} |")
    return "\n".join(rows)


def saturation_table(d) -> str:
    m = lambda name: d[name].nanmean(1)   # noqa: E731
    rows = ["| layer | Σp(1−p) scaled | Σp(1−p) unscaled | H/Hmax scaled | H/Hmax unscaled | max weight scaled | "
            "max weight unscaled | sink | entropy (nats) mean ± sd |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for L in range(d.n_layers):
        rows.append(
            f"| {L} | {float(m('saturation')[L]):.3f} | {float(m('saturation_unscaled')[L]):.3f} | "
            f"{float(m('entropy_frac_mean')[L]):.3f} | {float(m('entropy_frac_unscaled')[L]):.3f} | "
            f"{float(m('max_weight')[L]):.3f} | {float(m('max_weight_unscaled')[L]):.3f} | {float(m('sink')[L]):.3f} | "
            f"{float(m('entropy_mean')[L]):.2f} ± {float(m('entropy_std')[L]):.2f} |")
    return "\n".join(rows)


def flagged_table(d) -> str:
    rows = ["| head | flags | H/Hmax | max weight | sink | Var(q·k)/d_k |", "|---|---|---:|---:|---:|---:|"]
    for h, names in d.flagged():
        L, i = h.layer, h.head
        rows.append(f"| {h} | {', '.join(names)} | {float(d['entropy_frac_mean'][L, i]):.3f} | "
                    f"{float(d['max_weight'][L, i]):.3f} | {float(d['sink'][L, i]):.3f} | "
                    f"{float(d['qk_var_ratio'][L, i]):.2f} |")
    return "\n".join(rows)


def summary(d) -> str:
    r, ind = d["qk_var_ratio"], d["indep_ratio"]
    sat, sat_u = d["saturation"], d["saturation_unscaled"]
    return "\n".join([
        f"heads: {d.n_layers * d.n_heads}; Var(q·k)/d_k median {float(r.flatten().median()):.2f}, "
        f"range {float(r.min()):.2f}–{float(r.max()):.2f}",
        f"measured / independence prediction: median {float(ind.flatten().median()):.3f}, "
        f"range {float(ind.min()):.2f}–{float(ind.max()):.2f}",
        f"Σp(1−p) mean over heads: scaled {float(sat.mean()):.3f}, unscaled {float(sat_u.mean()):.3f}",
        f"largest weight on a later position: {float(d['future_weight'].max()):.3g}; "
        f"largest change before a changed later token: {float(d['perturb_change'].max()):.3g}",
        f"max |scale·q·k - hook_attn_scores| {float(d['scores_err'].max()):.3g}; "
        f"max |softmax(scores) - hook_pattern| {float(d['pattern_err'].max()):.3g}",
        f"scale: {sorted(set(round(float(s), 8) for s in d.scale))} from {d.settings['scale_source']}; "
        f"soft-cap {d.settings['softcap']}",
    ])


def write_pngs(d, out: Path) -> list:
    import plotly.graph_objects as go

    if not os.environ.get("BROWSER_PATH"):
        for path in ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"):
            if Path(path).exists():
                os.environ["BROWSER_PATH"] = path        # kaleido finds Debian's chromium this way
                break
    layers = list(range(d.n_layers))
    m = lambda name: d[name].nanmean(1).tolist()   # noqa: E731
    jitter = [L + (h - d.n_heads / 2) * 0.05 for L in layers for h in range(d.n_heads)]
    figs = {}
    f = go.Figure()
    f.add_trace(go.Scatter(x=jitter, y=d["qk_var_ratio"].flatten().tolist(), mode="markers", name="each head",
                           marker=dict(size=4, color="lightgray")))
    f.add_trace(go.Scatter(x=layers, y=m("qk_var_ratio"), mode="lines+markers", name="measured (mean)"))
    f.add_trace(go.Scatter(x=layers, y=[v / d.d_head for v in m("pred_var_indep")], mode="lines",
                           name="predicted, q independent of k", line=dict(dash="dash")))
    f.add_trace(go.Scatter(x=layers, y=[v / d.d_head for v in m("pred_var_components")], mode="lines",
                           name="predicted, independent components", line=dict(dash="dot")))
    f.add_trace(go.Scatter(x=layers, y=[v / d.d_head for v in m("pred_var_zero_mean")], mode="lines",
                           name="predicted, Σ Var(q_d)Var(k_d)", line=dict(dash="dashdot")))
    f.add_hline(y=1.0, line=dict(color="black", width=1))
    f.add_annotation(x=d.n_layers - 1, y=0, yref="y", text="textbook: Var = d_k", showarrow=False,
                     xanchor="right", yanchor="bottom")       # y in log10 units on a log axis
    f.update_layout(title=f"Var(q·k) / d_k per layer ({d.model})", xaxis_title="layer", yaxis_title="Var(q·k)/d_k",
                    yaxis_type="log")
    figs["qk_variance.png"] = f
    f = go.Figure()
    f.add_trace(go.Scatter(x=layers, y=m("saturation"), mode="lines+markers", name="with the model's 1/√d_k"))
    f.add_trace(go.Scatter(x=layers, y=m("saturation_unscaled"), mode="lines+markers", name="without scaling"))
    f.add_trace(go.Scatter(x=layers, y=m("sink"), mode="lines", name="share on first token", line=dict(dash="dot")))
    f.update_layout(title="softmax saturation: mean Σ p(1−p) per row (0 = one-hot)", xaxis_title="layer",
                    yaxis_title="Σ p(1−p)", yaxis_range=[0, 1])
    figs["saturation.png"] = f
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in figs.items():
        fig.update_layout(width=760, height=380, margin=dict(l=60, r=20, t=50, b=50), template="plotly_white")
        fig.write_image(str(out / name))
        written.append(out / name)
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--n-seqs", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the full HeadDiagnostics JSON here")
    p.add_argument("--png", help="folder for PNG plots (needs kaleido)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model = qk.load(args.model, device=args.device, verbose=False)
    t0 = time.perf_counter()
    d = qk.diagnose(model, n_seqs=args.n_seqs, seed=args.seed)
    took = time.perf_counter() - t0
    print(f"## {d.model}: diagnose took {took:.1f} s ({torch.get_num_threads()} CPU thread), prompt sets "
          f"{d.settings['prompt_sets']}\n")
    print(summary(d), "\n")
    print(layer_table(d), "\n")
    print(saturation_table(d), "\n")
    print(flagged_table(d))
    if args.json:
        d.to_json(args.json)
    if args.png:
        try:
            for path in write_pngs(d, Path(args.png)):
                print(f"wrote {path}", file=sys.stderr)
        except (ImportError, ValueError, RuntimeError) as e:
            print(f"no PNGs ({type(e).__name__}: {e}); pip install kaleido and a Chrome/Chromium", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
