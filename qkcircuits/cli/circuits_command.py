"""``qkcircuits circuits MODEL --head 3.1 [--tokens TEXT] [--json PATH]``: one head's circuits in brief.

    $ qkcircuits circuits smollm2-135m --head 16.0 [--verify]
    head 16.0 of HuggingFaceTB/SmolLM2-135M-Instruct  (fold_ln True, scale 0.125, rotary halves base 100000)
    eigen copying: OV -0.225, full OV (W_E·OV·W_U) -0.208  (rank 192 of 270 by full OV)
    KV cache: 1,536 B per token per layer (GQA 3 of 9), 0.33x of multi-head attention (4,608 B), fp32
    K-composition partners (baseline 0.0416 subtracted): 14.3 0.017, 15.7 0.017, 15.2 0.016, 14.5 0.016, 15.8 0.015
    offset profile (rotary) over 0-64 (rows: layer 16's input over 869 corpus tokens (contextual mean, BOS left out)): prefers offset 1 (score 2.45; at 0: -2.5; range 25.8)
    copying rank (contextual inputs): median 22448 of 49152, top-1 for 0% of 64 corpus tokens in the token pool (271)

Prints the eigenvalue copying scores, the earlier heads the head's keys read most (K-composition),
positions (the offset profile the report and ``qk.plot.offsets`` draw: ``_weights/offsets``), and for ``--tokens``
the output tokens the full OV circuit sends the first tokens to. ``--json`` writes all of it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from .._foundation.errors import QKCircuitsError
from ._common import add_model_args, head_arg, json_arg, load_model, positive_int, write_output


def add_parser(sub) -> None:
    p = sub.add_parser("circuits", help="one head's QK/OV circuits: copying, K-composition partners, positions",
                       description="Summarise one head's circuits: eigenvalue copying score of OV and of the full OV "
                                   "circuit, top K-composition partners (random baseline subtracted), and its "
                                   "position preference. Conventions: docs/circuits.md.")
    add_model_args(p)
    p.add_argument("--head", required=True, type=head_arg, help="the head, e.g. 3.1 or L3H1")
    p.add_argument("--tokens", default=None,
                   help="text whose residual rows feed the offset profile and whose first tokens' full-OV outputs are "
                        "listed (default: natural text when the model has a tokenizer)")
    p.add_argument("--k", type=positive_int, default=5, help="partners / output tokens to list (default 5)")
    p.add_argument("--offsets", type=positive_int, default=64, help="largest offset in the profile (default 64)")
    p.add_argument("--view", choices=("direct", "effective", "contextual"), default=None,
                   help="token rows of the OV view and copying rank (default: direct at layer 0, contextual after)")
    json_arg(p, "the summary as JSON")
    p.add_argument("--verify", action="store_true",
                   help="also check every head's factored QK/OV against the model's own scores and head outputs "
                        "(qk.verify_circuits); exit 1 if any relative error exceeds 1e-4 (float32; 4 x the dtype's epsilon "
                        "in bf16/fp16)")
    p.set_defaults(func=run)


def summarize(model, head, text=None, top: int = 5, max_offset: int = 64, input=None) -> dict:
    """The summary ``run`` prints, as plain data (also what ``--json`` writes)."""
    import torch

    from .._foundation.capture import has_rotary
    from .._weights.qk_ov import attn_scale, circuit_caveats, is_folded
    from .._weights.composition import composition_baseline, k_composition_partners
    from .._weights.contextual import check_input, copying_tokens, head_logits, mid_rank
    from .._weights.copying import copying_scores
    from .._foundation.heads import model_heads
    from .._foundation.model import model_name
    from .._weights.offsets import head_offset_profile
    from .._weights.rotary import rotary_spec
    from .._weights.kv_cache import kv_cache
    from .._foundation.arch import adapter

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
    spec = rotary_spec(model, layer=h.layer) if has_rotary(model) else None
    prof = head_offset_profile(model, h, max_offset, text=text, spec=spec)     # the report's and qk.plot's profile
    if prof is not None:
        out["positions"] = {"kind": prof["kind"], "rows": prof["rows"], "head": str(h),
                            **{k: prof[k] for k in ("preferred_offset", "score_at_preferred", "score_at_0",
                                                    "score_range", "flat")},
                            "offsets": [prof["offsets"][0], prof["offsets"][-1]],
                            "mean_score": [round(float(v), 5) for v in prof["score"]]}
    if spec is not None:
        out["rotary"] = spec.describe()
        out["positions"]["layer_type"] = spec.layer_type
        out["caveats"] = out["caveats"] + [c for c in spec.caveats if c not in out["caveats"]]
    ids, where = copying_tokens(model, 64, 0)
    logits, used = head_logits(model, h, ids.tolist(), input)
    ranks = mid_rank(logits, ids)
    out["token_views"] = {"input": input, "note": used.note, "tokens": where, "n_tokens": len(ids),
                          "vocabulary": int(logits.shape[-1]), "copying_rank_median": float(ranks.median()),
                          "top1_share": float((ranks == 1).float().mean())}
    if text is not None:
        tok = model.tokenizer
        first = tok(text, add_special_tokens=False)["input_ids"][:3]
        logits, _ = head_logits(model, h, first, input)
        r = mid_rank(logits, torch.tensor(first))
        out["ov_top"] = []
        for i, t in enumerate(first):
            vals, idx = logits[i].topk(top)
            out["ov_top"].append({"token": tok.decode([t]), "copying_rank": float(r[i]),
                                  "top": [[tok.decode([j]), round(float(v), 4)] for v, j in zip(vals.tolist(), idx.tolist())]})
    return out


def format_summary(s: dict) -> str:
    from .._weights.offsets import describe

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
        last = p["offsets"][-1] if "offsets" in p else len(p["mean_score"]) - 1
        lines.append(f"offset profile ({p['kind']}) over 0-{last} (rows: {p['rows']}): {describe(p)}")
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


def run(args) -> int:
    if args.json and not Path(args.json).expanduser().resolve().parent.is_dir():
        raise QKCircuitsError(f"cannot write {args.json!r}: its folder does not exist")
    model = load_model(args)
    from .._foundation.heads import model_heads

    head = model_heads(model, args.head)
    if len(head) != 1:
        raise QKCircuitsError(f"--head names {len(head)} heads ({args.head!r}); give exactly one, e.g. 3.1")
    if args.tokens is not None and getattr(model, "tokenizer", None) is None:
        raise QKCircuitsError("--tokens needs a model with a tokenizer; this one has none")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = summarize(model, head[0], args.tokens, args.k, args.offsets, args.view)
    print(format_summary(s))
    for w in caught:         # a caveat is printed once, as a "caveat:" line above; any other warning as usual
        if not any(c in str(w.message) for c in s["caveats"]):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    check = None
    if args.verify:
        from .._weights.verify import verify_circuits

        check = verify_circuits(model)
        s["verify"] = check.to_dict()
        print(check)
        for _, row in check.worst(3).iterrows():
            print(f"  head {row['head']}: QK {row['qk_error']:.2e} (vs {row['score_source']}), "
                  f"OV {row['ov_error']:.2e}")
    write_output(args.json, s)
    return 1 if check is not None and not check.passed else 0
