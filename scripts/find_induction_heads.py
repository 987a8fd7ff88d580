"""Find the induction heads of GPT-2 (or any model qkcircuits can load): the script version of the notebook
docs/examples/induction_heads.ipynb, step for step.

    python scripts/find_induction_heads.py                       # gpt2 (needs the hub or its local cache)
    python scripts/find_induction_heads.py --model smollm2-135m  # offline: the GGUF shipped on PyPI
    python scripts/find_induction_heads.py --model path/to/hf_folder_or.gguf --figures out/figures

Expected for GPT-2 small (ARENA): 5.1, 5.5, 6.9, 7.2, 7.10. ``--figures DIR`` writes every figure of the
notebook as one offline HTML file. Bad input (a hub name without the hub, a bad path): one ``error:`` line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import qkcircuits as qk


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2", help="hub name, local folder, .gguf, smollm2-135m or toy-induction")
    parser.add_argument("--top", type=int, default=5, help="heads listed per score (default 5)")
    parser.add_argument("--figures", metavar="DIR", help="write each figure as an offline HTML file into DIR")
    args = parser.parse_args(argv)
    try:
        if args.top < 1:
            raise qk.QKCircuitsError(f"--top must be at least 1, got {args.top}")
        run(args)
    except qk.QKCircuitsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run(args) -> None:
    # 1. load and scan: one streamed pass per prompt set
    model = qk.load(args.model)
    scores = qk.scan(model)
    print(scores)                                        # short summary: the top heads per label

    # 2. the top induction and previous-token heads
    induction = scores.top(args.top, "induction")
    previous = scores.top(args.top, "previous_token")
    print("induction heads (score >= 0.4):", ", ".join(map(str, scores.heads_labelled("induction"))) or "none")
    for head, score in induction:
        print(f"  {head}: induction {score:.3f}, prefix matching "
              f"{float(scores['prefix_matching'][head.layer, head.head]):.3f}")
    print("previous-token heads:", ", ".join(f"{h} ({v:.3f})" for h, v in previous))
    top_induction, top_previous = induction[0][0], previous[0][0]

    # 3. attention patterns on a sentence said twice
    view = qk.plot.attention(model, None, [top_induction, top_previous])
    print(view)                                      # .pattern [head, query, key]; saved with --figures

    # 4. QK and OV circuits of the top induction head, offsets of the top previous-token head
    figures = {"scores-induction": qk.plot.scores(scores, "induction"),
               "scores-previous_token": qk.plot.scores(scores, "previous_token"),
               f"qk-{top_induction}": qk.plot.qk(model, top_induction),
               f"ov-{top_induction}": qk.plot.ov(model, top_induction)}
    ov = figures[f"ov-{top_induction}"].data[0]
    copies = sum(row[0][2] == "yes" for row in ov.customdata)
    print(f"{top_induction} OV: {copies} of {len(ov.customdata)} tokens raise themselves most (it copies)")
    try:
        figures[f"offsets-{top_previous}"] = qk.plot.offsets(model, top_previous)
    except qk.QKCircuitsError as e:                   # a model without positions in its QK circuit
        print(f"no offset profile: {e}")

    # 5. ablation against random heads
    heads = scores.heads_labelled("induction") or [top_induction]
    tokens = qk.repeated_tokens(model, n_seqs=8, seg_len=qk.segment_length(model), seed=0)
    comparison = qk.compare_to_random(model, heads, tokens, "induction-loss", n_draws=20, seed=0)
    print(comparison)
    figures["ablation-vs-random"] = qk.plot.effects(comparison)

    if args.figures:
        out = Path(args.figures)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise qk.QKCircuitsError(f"cannot create --figures folder {str(out)!r}: {e.strerror}") from None
        for name, fig in figures.items():
            fig.save(out / f"{name}.html")
        view.save(out / "attention.html")
        print(f"wrote {len(figures) + 1} offline HTML figures to {out}/")


if __name__ == "__main__":
    sys.exit(main())
