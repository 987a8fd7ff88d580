"""``qkcircuits circuits MODEL --head 3.1 [--tokens TEXT] [--json PATH]``: one head's circuits in brief.

    $ qkcircuits circuits smollm2-135m --head 29.2 [--verify]
    head 29.2 of HuggingFaceTB/SmolLM2-135M-Instruct  (fold_ln True, scale 0.125, rotary halves base 100000)
    eigen copying: OV 0.999, full OV (W_E·OV·W_U) 0.999  (rank 1 of 270 by full OV)
    K-composition partners (baseline 0.0416 subtracted): 22.4 0.031, 6.4 0.027, 0.2 0.026, 0.0 0.025, 2.4 0.022
    offset profile (rotary) over 0-64 (rows: 66 tokens of natural text): prefers offset 1 (score 5.53; at 0: 5.49; range 2.6)

Prints the eigenvalue copying scores, the earlier heads the head's keys read most (K-composition),
positions (rotary: the offset profile; learned: the positional QK by offset), and for ``--tokens``
the output tokens the full OV circuit sends the first tokens to. ``--json`` writes all of it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .._foundation.errors import QKCircuitsError
from ._common import add_model_args, finite_json, load_model, positive_int, write_atomic, renamed_arg


def add_parser(sub) -> None:
    p = sub.add_parser("circuits", help="one head's QK/OV circuits: copying, K-composition partners, positions",
                       description="Summarise one head's circuits: eigenvalue copying score of OV and of the full OV "
                                   "circuit, top K-composition partners (random baseline subtracted), and its "
                                   "position preference. Conventions: docs/circuits.md.")
    add_model_args(p)
    p.add_argument("--head", required=True, help="the head, e.g. 3.1 or L3H1")
    p.add_argument("--tokens", default=None,
                   help="text whose residual rows feed the offset profile and whose first tokens' full-OV outputs are "
                        "listed (default: natural text when the model has a tokenizer)")
    renamed_arg(p, "--k", "--top", type=positive_int, default=5, help="partners / output tokens to list (default 5)")
    p.add_argument("--offsets", type=positive_int, default=64, help="largest offset in the profile (default 64)")
    renamed_arg(p, "--view", "--input", choices=("direct", "effective", "contextual"), default=None,
                help="token rows of the OV view and copying rank (default: direct at layer 0, contextual after)")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    p.add_argument("--verify", action="store_true",
                   help="also check every head's factored QK/OV against the model's own scores and head outputs "
                        "(qk.verify_circuits); exit 1 if any relative error exceeds 1e-4 (float32; 4 x the dtype's epsilon "
                        "in bf16/fp16)")
    p.set_defaults(func=run)


def summarize(model, head, text=None, top: int = 5, max_offset: int = 64, input=None) -> dict:
    """The summary ``run`` prints, as plain data (also what ``--json`` writes)."""
    import torch

    from .._foundation.capture import has_rotary
    from .._weights.circuits import attn_input_hook, attn_scale, circuit_caveats, is_folded
    from .._weights.composition import composition_baseline, k_composition_partners
    from .._weights.contextual import check_input, copying_tokens, head_logits, mid_rank
    from .._weights.copying import copying_scores
    from .._foundation.heads import model_heads
    from .._foundation.model import model_name
    from .._weights.rotary import offset_profile, positional_qk, rotary_spec
    from .._weights.kv_cache import kv_cache
    from .._foundation.arch import adapter
    from .._foundation.arch.model import positional

    h = model_heads(model, head)[0]
    input = check_input(input, h.layer)
    full, plain = copying_scores(model), copying_scores(model, full=False)
    rank = int((full.flatten() > full[h.layer, h.head]).sum()) + 1
    out: dict = {"head": str(h), "model": model_name(model), "fold_ln": is_folded(model),
                 "attn_scale": attn_scale(model, h.layer), "caveats": circuit_caveats(model),
                 "copying": {"ov": float(plain[h.layer, h.head]), "full_ov": float(full[h.layer, h.head]),
                             "full_ov_rank": rank, "n_heads": full.numel()}}
    partners = k_composition_partners(model, [h], k=top, min_score=float("-inf"))[h]
    out["kv_cache"] = kv_cache(model).summary()
    out["k_composition"] = {"baseline": composition_baseline(int(model.cfg.d_model), adapter(model, h.layer).d_qk),
                            "partners": [[str(p), round(v, 6)] for p, v in partners]}
    tokens = None
    if getattr(model, "tokenizer", None) is not None:
        from .._foundation.sequences import text_tokens
        tokens = text_tokens(model, text, seq_len=min(max_offset + 1, int(model.cfg.n_ctx) - 1), n_seqs=1) \
            if text is None else model.to_tokens(text)[:, :model.cfg.n_ctx]
    offs = range(0, max_offset + 1)
    if has_rotary(model):
        spec = rotary_spec(model, layer=h.layer)
        if spec.window:               # keys further back are masked on this layer: no score to profile
            offs = range(0, min(max_offset, spec.window - 1) + 1)
        x, rows = None, "normalised token embeddings"
        if tokens is not None:
            name = attn_input_hook(model, h.layer)
            with torch.no_grad():
                _, cache = model.run_with_cache(tokens, names_filter=lambda n: n == name,
                                                stop_at_layer=h.layer + 1)
            x, rows = cache[name][0], f"{tokens.shape[1]} tokens of {'the given text' if text else 'natural text'}"
        prof = offset_profile(model, h, offs, x, spec=spec)
        out["rotary"] = spec.describe()
        out["positions"] = {"kind": "rotary", "rows": rows + (f"; offsets < window {spec.window}" if spec.window else ""),
                            **prof.summary(), "layer_type": spec.layer_type,
                            "mean_score": [round(float(v), 5) for v in prof.mean_score]}
        out["caveats"] = out["caveats"] + list(spec.caveats)
    elif positional(model) in ("standard", "shortformer"):
        P = positional_qk(model, h)
        n = min(P.ldim, 4 * (max_offset + 1))
        grid = (P.A[:n] @ P.B[:, :n]) * attn_scale(model, h.layer)
        by = [float(grid.diagonal(-d).mean()) for d in offs if d < n]
        best = max(range(len(by)), key=by.__getitem__)
        out["positions"] = {"kind": "learned", "rows": f"W_pos rows 0-{n - 1}", "preferred_offset": best,
                            "score_at_preferred": by[best], "score_at_0": by[0], "score_range": max(by) - min(by),
                            "mean_score": [round(v, 5) for v in by]}
    ids, where = copying_tokens(model, 64, 0)
    logits, used = head_logits(model, h, ids.tolist(), input)
    ranks = mid_rank(logits, ids)
    out["token_views"] = {"input": input, "note": used.note, "tokens": where, "n_tokens": len(ids),
                          "vocabulary": int(logits.shape[-1]), "copying_rank_median": float(ranks.median()),
                          "top1_share": float((ranks == 1).float().mean())}
    if tokens is not None and text is not None:
        tok = model.tokenizer
        first = tokens[0, :3].tolist()
        logits, _ = head_logits(model, h, first, input)
        r = mid_rank(logits, torch.tensor(first))
        out["ov_top"] = []
        for i, t in enumerate(first):
            vals, idx = logits[i].topk(top)
            out["ov_top"].append({"token": tok.decode([t]), "copying_rank": float(r[i]),
                                  "top": [[tok.decode([j]), round(float(v), 4)] for v, j in zip(vals.tolist(), idx.tolist())]})
    return out


def format_summary(s: dict) -> str:
    rot = s.get("rotary")
    pos = f", rotary {rot['style']} base {rot['base']:g}" if rot and rot.get("base") else ""
    lines = [f"head {s['head']} of {s['model']}  (fold_ln {s['fold_ln']}, scale {s['attn_scale']:.6g}{pos})"]
    c = s["copying"]
    lines.append(f"eigen copying: OV {c['ov']:.3f}, full OV (W_E·OV·W_U) {c['full_ov']:.3f}  "
                 f"(rank {c['full_ov_rank']} of {c['n_heads']} by full OV)")
    k = s["k_composition"]
    parts = ", ".join(f"{p} {v:.3f}" for p, v in k["partners"]) or "none (layer 0)"
    if s.get("kv_cache"):
        lines.append(s["kv_cache"])
    lines.append(f"K-composition partners (baseline {k['baseline']:.4f} subtracted): {parts}")
    p = s.get("positions")
    if p:
        head = f"offset profile ({p['kind']}) over 0-{len(p['mean_score']) - 1} (rows: {p['rows']}): "
        if not _has_preference(p):
            lines.append(head + f"no positional preference (the score is {p['score_at_0']:.3g} at every offset)")
        else:
            lines.append(head + f"prefers offset {p['preferred_offset']} (score {p['score_at_preferred']:.3g}; at 0: "
                         f"{p['score_at_0']:.3g}; range {p['score_range']:.3g})")
    tv = s.get("token_views")
    if tv:
        lines.append(f"copying rank ({tv['input']} inputs): median {tv['copying_rank_median']:g} of {tv['vocabulary']}, "
                     f"top-1 for {100 * tv['top1_share']:.0f}% of {tv['n_tokens']} {tv['tokens']}")
    for row in s.get("ov_top", []):
        lines.append(f"OV ({tv['input']}) {row['token']!r} (own rank {row['copying_rank']:g}) -> "
                     + ", ".join(f"{t!r} {v:.3g}" for t, v in row["top"]))
    for cav in s["caveats"]:
        lines.append(f"caveat: {cav}")
    return "\n".join(lines)


def _has_preference(p: dict) -> bool:
    """False when the profile is flat (e.g. all zero: a head whose QK circuit is zero), where "prefers
    offset 0" would only be argmax's tie-break."""
    scale = max(abs(v) for v in p["mean_score"]) if p["mean_score"] else 0.0
    return p["score_range"] > 1e-6 * max(scale, 1e-30)


def run(args) -> int:
    if args.json and not Path(args.json).expanduser().resolve().parent.is_dir():
        raise QKCircuitsError(f"cannot write {args.json!r}: its folder does not exist")
    model = load_model(args)
    from .._foundation.heads import model_heads
    from .._foundation.model import model_name

    head = model_heads(model, args.head)
    if len(head) != 1:
        raise QKCircuitsError(f"--head names {len(head)} heads ({args.head!r}); give exactly one, e.g. 3.1")
    if args.tokens is not None and getattr(model, "tokenizer", None) is None:
        raise QKCircuitsError("--tokens needs a model with a tokenizer; this one has none")
    s = summarize(model, head[0], args.tokens, args.k, args.offsets, args.view)
    print(format_summary(s))
    check = None
    if args.verify:
        from .._weights.verify import verify_circuits

        check = verify_circuits(model)
        s["verify"] = check.to_dict()
        print(check)
        for _, row in check.worst(3).iterrows():
            print(f"  head {row['head']}: QK {row['qk_error']:.2e} (vs {row['score_source']}), "
                  f"OV {row['ov_error']:.2e}")
    if args.json:
        write_atomic(str(Path(args.json).expanduser()), json.dumps(finite_json(s), indent=1, allow_nan=False))
        print(f"wrote {args.json}", file=sys.stderr)
    return 1 if check is not None and not check.passed else 0
