"""``qkcircuits diagnose MODEL [--json PATH]``: per-head health, flagged heads first.

    $ qkcircuits diagnose smollm2-135m --json diag.json
    head   flags                        Var(qk)/dk scaled var meas/indep H/Hmax  max w   sink Σp(1-p) unscaled ...
    0.0    near_uniform                       0.99       0.99       1.25  0.950  0.091  0.043   0.946    0.583
    18.8   near_one_hot,sink_dominated       61.61      61.61       0.99  0.012  0.979  0.979   0.027    0.002
    ...
    10 of 270 heads flagged (near_uniform 5, near_one_hot 3, sink_dominated 4, leaking 0).
    causal mask: OK: no weight on later positions, earlier positions unchanged when later tokens change
"""

from __future__ import annotations

import sys
from pathlib import Path

from .._foundation.errors import QKCircuitsError
from ._common import add_model_args, json_arg, load_model, non_negative_int, positive_int, write_output

_COLUMNS = [  # (measure, header, format)
    ("qk_var_ratio", "Var(qk)/dk", "{:10.2f}"),
    ("scaled_var", "scaled var", "{:10.2f}"),
    ("indep_ratio", "meas/indep", "{:10.2f}"),
    ("entropy_frac_mean", "H/Hmax", "{:6.3f}"),
    ("max_weight", "max w", "{:6.3f}"),
    ("sink", "sink", "{:6.3f}"),
    ("saturation", "Σp(1-p)", "{:7.3f}"),
    ("saturation_unscaled", "unscaled", "{:8.3f}"),
    ("future_weight", "future w", "{:8.2g}"),
    ("perturb_change", "Δ earlier", "{:9.2g}"),
]


def add_parser(sub) -> None:
    p = sub.add_parser(
        "diagnose", help="head health: Var(q·k) vs d_k, entropy, sinks, saturation, causal-mask leaks",
        description="Measure every head in one streamed pass per prompt set (natural text, repeated random "
                    "tokens) and list the heads flagged near-uniform, near-one-hot, sink-dominated or leaking. "
                    "Thresholds: docs/diagnostics.md.")
    add_model_args(p)
    p.add_argument("--prompts", choices=("both", "text", "repeated"), default="both",
                   help="prompt sets (default both; 'text' needs a tokenizer, without one only 'repeated' runs)")
    p.add_argument("--n-seqs", type=positive_int, default=8, help="sequences per prompt set (default 8)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="natural-text tokens per row (default 128)")
    p.add_argument("--seg-len", type=positive_int, default=None,
                   help="repeated segment length, sequences are BOS + 2 copies (default 40)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the random segments (default 0)")
    p.add_argument("--all", action="store_true", help="list every head, not only the flagged ones")
    json_arg(p, "the full result (every measure, every head) as JSON")
    p.set_defaults(func=run)


def format_table(diag, all_heads: bool = False) -> str:
    """The per-head table: flagged heads (or every head with ``all_heads``), then a summary."""
    flags = diag.flags()
    heads = ([(h, n) for h, n in diag.flagged()] if not all_heads else
             [(h, [f for f in flags if bool(flags[f][h.layer, h.head])]) for h in _every(diag)])
    header = f"{'head':<6} {'flags':<34} " + " ".join(f"{t:>{len(fmt.format(0.0))}}" for _, t, fmt in _COLUMNS)
    lines = [header]
    for h, names in heads:
        cells = []
        for m, _, fmt in _COLUMNS:
            v = float(diag[m][h.layer, h.head])
            cells.append(fmt.format(v) if v == v else f"{'-':>{len(fmt.format(0.0))}}")
        lines.append(f"{str(h):<6} {','.join(names) or '-':<34} " + " ".join(cells))
    n = diag.n_layers * diag.n_heads
    counts = ", ".join(f"{k} {int(v.sum())}" for k, v in flags.items())
    t = diag.thresholds
    lines.append("")
    lines.append(f"{len(diag.flagged())} of {n} heads flagged ({counts}).")
    lines.append(f"thresholds: near_uniform H/Hmax >= {t['near_uniform']}, near_one_hot max w >= {t['near_one_hot']}, "
                 f"sink_dominated sink >= {t['sink_dominated']}, leaking future w or Δ earlier > {t['leak_tol']}")
    leaking = int(flags["leaking"].sum())
    lines.append("causal mask: " + ("OK: no weight on later positions, earlier positions unchanged when later tokens "
                                    "change" if leaking == 0 else f"LEAK in {leaking} heads"))
    scale = diag.scale[~diag.scale.isnan()]
    if len(scale):
        lo, hi = float(scale.min()), float(scale.max())
        same = abs(hi - lo) <= 1e-6 * abs(hi)
        source = ", ".join(diag.settings.get("scale_source", []))
        lines.append(f"scale on q·k: {lo:.6g}" + ("" if same else f" to {hi:.6g}") +
                     f" (1/sqrt(d_head) = {diag.d_head ** -0.5:.6g}; read from {source})"
                     + (f"; soft-cap {diag.settings['softcap']}" if diag.settings.get("softcap") else ""))
    return "\n".join(lines)


def _every(diag):
    from .._foundation.heads import all_heads

    return all_heads(diag.n_layers, diag.n_heads)


def run(args) -> int:
    from .._analysis.diagnose import diagnose

    if args.json and not Path(args.json).expanduser().resolve().parent.is_dir():
        raise QKCircuitsError(f"cannot write {args.json!r}: its folder does not exist")
    model = load_model(args)
    if args.prompts == "both":
        sets = (["text"] if getattr(model, "tokenizer", None) is not None else []) + ["repeated"]
    else:
        sets = [args.prompts]
    diag = diagnose(model, prompt_sets=sets, n_seqs=args.n_seqs, seq_len=args.seq_len, seg_len=args.seg_len,
                    seed=args.seed, progress=sys.stderr.isatty())
    print(format_table(diag, all_heads=args.all))
    write_output(args.json, diag)
    return 0
