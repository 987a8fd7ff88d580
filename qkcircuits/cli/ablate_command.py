"""``qkcircuits ablate MODEL --heads 5.1,5.5``: the metric with heads ablated; ``--sweep``: every head alone."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

from .._foundation.errors import QKCircuitsError
from ._common import (add_model_args, head_arg, json_arg, load_model, non_negative_int, positive_int, ray_arg,
                      ray_backend, write_output)

METRICS = ("induction-loss", "text-loss")     # the table's token-row names with default prompts (default_tokens)


def add_parser(sub) -> None:
    p = sub.add_parser("ablate", help="ablate heads (zero/mean/resample) and measure the loss change; --sweep: all",
                       description="Ablate attention heads at hook_z (the head's output before W_O) and print the "
                                   "baseline, the ablated value and the change of the metric.")
    add_model_args(p)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--heads", type=head_arg, help="heads ablated together, e.g. 5.1,5.5 or L5H1 or 5.*")
    what.add_argument("--sweep", action="store_true", help="ablate every head alone and list the largest effects")
    p.add_argument("--method", choices=("zero", "mean", "resample"), default="zero",
                   help="zero; mean over the prompts (per position); resample from the prompts rolled by one row")
    p.add_argument("--metric", choices=METRICS, default="induction-loss",
                   help="induction-loss: loss on the repeated half of [BOS]+R+R; text-loss: loss on packaged text")
    p.add_argument("--n-seqs", type=positive_int, default=8, help="prompts (default 8)")
    p.add_argument("--seg-len", type=positive_int, default=None,
                   help="induction-loss: length of the random segment R of [BOS]+R+R (default 40, capped by context "
                        "and vocabulary)")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help="text-loss: tokens per text row (default 40)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the random prompts (default 0)")
    p.add_argument("--k", type=positive_int, default=10, help="heads listed after --sweep (default 10)")
    ray_arg(p, "--sweep")
    json_arg(p, "the result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .._analysis.ablate import group_effect
    from .._foundation.heads import model_heads
    from .._analysis.metrics import as_metric, default_tokens
    from .._analysis.sweep import sweep

    if args.ray is not None:
        if not args.sweep:
            raise QKCircuitsError("--ray runs --sweep on Ray workers; add --sweep (or drop --ray for --heads)")
        return run_ray(args)
    t0 = time.perf_counter()
    model = load_model(args)
    load_s = time.perf_counter() - t0
    metric = as_metric(args.metric, model)
    heads = model_heads(model, args.heads) if args.heads is not None else None   # bad heads fail before any forward
    tokens = default_tokens(model, metric, n_seqs=args.n_seqs, seed=args.seed, **prompt_lengths(args))
    if args.method == "resample" and tokens.shape[0] < 2:
        raise QKCircuitsError("--method resample takes each prompt's z from another prompt: use --n-seqs 2 or more")
    out = {"model": args.model, "method": args.method, "metric": metric.name, "n_seqs": int(tokens.shape[0]),
           "n_positions": int(tokens.shape[1]), "seed": args.seed}
    if args.sweep:
        res = sweep(model, tokens, metric, args.method, progress=not args.quiet)
        res = replace(res, timing={"startup_s": 0.0, "load_s": round(load_s, 3), **res.timing})
        out = _print_sweep(args, res, out)
    else:
        g = group_effect(model, heads, tokens, metric, args.method)
        out.update(heads=[str(h) for h in g.heads], baseline=g.baseline, ablated=g.ablated, effect=g.effect)
        print(f"{args.model}: {metric.name} over {tokens.shape[0]} prompts x {tokens.shape[1]} tokens, "
              f"{args.method} ablation of {', '.join(str(h) for h in g.heads)}")
        print(f"  baseline {g.baseline:.4f}   ablated {g.ablated:.4f}   change {g.effect:+.4f}")
    _write(args, out)
    return 0


def run_ray(args: argparse.Namespace) -> int:
    """The sweep on Ray: workers load the model and draw the prompts; this process loads no weights."""
    from .._analysis.sweep import sweep

    res = sweep(args.model, {"n_seqs": args.n_seqs, "seed": args.seed, **prompt_lengths(args)}, args.metric,
                args.method, progress=not args.quiet, backend=ray_backend(args))
    out = {"model": args.model, "method": args.method, "metric": res.metric, "n_seqs": res.n_prompts,
           "n_positions": res.n_positions, "seed": args.seed}
    _write(args, _print_sweep(args, res, out))
    return 0


def prompt_lengths(args: argparse.Namespace) -> dict:
    """``seg_len`` (induction-loss: R) or ``seq_len`` (text-loss: a row) for ``default_tokens``, from
    ``--seg-len``/``--seq-len``. The flag that does not apply to the metric is refused."""
    induction = args.metric.startswith("induction")
    if induction and args.seq_len is not None:
        raise QKCircuitsError(f"--seq-len is the length of text-loss rows; --metric {args.metric} takes --seg-len "
                              f"(the length of R)")
    if not induction and args.seg_len is not None:
        raise QKCircuitsError(f"--seg-len is the repeated segment of induction-loss prompts; --metric {args.metric} "
                              f"rows take --seq-len")
    out = {"seg_len": args.seg_len} if induction else {"seq_len": args.seq_len}
    return {k: v for k, v in out.items() if v is not None}


def _print_sweep(args, res, out: dict) -> dict:
    """Print the top effects; return every HeadEffects field (so `report --ablation` reads it) + the CLI's keys."""
    out = {**json.loads(res.to_json()), **out}
    print(f"{args.model}: {res.metric} baseline {res.baseline:.4f} over {res.n_prompts} prompts x "
          f"{res.n_positions} tokens; {args.method} ablation of each head alone, largest effects:")
    for head, value in res.top(args.k):
        print(f"  {str(head):<8}{value:+.4f}")
    t = res.timing
    if res.backend.get("name") == "ray":
        print(f"  ray: {res.backend['workers']} workers, {res.backend['shards']} shards; start-up {t['startup_s']:.1f} s, "
              f"load {t['load_s']:.1f} s, sweep {t['sweep_s']:.1f} s", file=sys.stderr)
    return out


def _write(args, out: dict) -> None:
    write_output(args.json, out)
