"""EAP-IG's three rules (and EAP) against exact edge patching on the tiny random families (issue 35 ask 6).

    PYTHONPATH=. python benchmarks/study_ig_rules.py [--seeds 10] [--out rules.json]

For GPT-2, Llama-GQA and Gemma-3 (``tests/_tiny.py``) and task seeds 0 … seeds−1 (``contrast_task`` of
``tests/test_circuit_scores.py``: 64 prompts, 10 tokens, a behaviour each model has by construction): the
Spearman correlation over all edges, signed, of EAP and of EAP-IG (5 steps) under the left, right and midpoint
rules with the exact scores. One thread. docs/tasks.md holds the 2026-12-05 numbers.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    import qkcircuits as qk
    from qkcircuits._foundation.stats import spearman
    from _tiny import tiny_gemma3, tiny_gpt2, tiny_llama_gqa
    from test_circuit_scores import contrast_task

    warnings.simplefilter("ignore")
    d = pathlib.Path(tempfile.mkdtemp())
    out = {}
    for name, build in (("gpt2", tiny_gpt2), ("llama-gqa", tiny_llama_gqa), ("gemma3", tiny_gemma3)):
        model = qk.load(str(build(d / name)), verbose=False)
        g = qk.graph(model)
        for seed in range(args.seeds):
            task = contrast_task(model, seed=seed)
            ex = qk.edge_scores(model, task, method="exact", progress=False).scores[g.valid]
            row = {"eap": spearman(qk.edge_scores(model, task, method="eap", progress=False).scores[g.valid], ex)}
            for rule in ("left", "right", "midpoint"):
                s = qk.edge_scores(model, task, method="eap-ig", steps=5, rule=rule, progress=False)
                row[rule] = spearman(s.scores[g.valid], ex)
            out.setdefault(name, {})[seed] = {k: round(float(v), 3) for k, v in row.items()}
            print(name, seed, out[name][seed], flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
