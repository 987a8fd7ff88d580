"""``qkcircuits trace MODEL``: which earlier heads feed the top induction heads' queries, keys and values."""

from __future__ import annotations

import argparse
import sys

from .._foundation.errors import QKCircuitsError
from ._common import (add_model_args, head_arg, json_arg, load_model, positive_int, ray_arg, ray_backend,
                      write_output)

INPUT_WORDS = {"q": "queries", "k": "keys", "v": "values"}


def _into(text: str):
    parts = [t for t in text.replace(" ", "").split(",") if t]
    bad = [t for t in parts if t not in INPUT_WORDS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of q,k,v, got {text!r}")
    return [x for x in "qkv" if x in parts]


def add_parser(sub) -> None:
    p = sub.add_parser("trace", help="path-patch every earlier head into the top induction heads' q/k/v",
                       description="For each receiver head (default: the top induction heads of a scan), replace "
                                   "each earlier head's output (mean/zero/resample) only on its path into the "
                                   "receiver's queries, keys or values and measure the harm: for q and k the "
                                   "receiver's induction attention, for v its direct logit for the correct token.")
    add_model_args(p)
    p.add_argument("--receivers", type=head_arg, help="receiver heads, e.g. 18.6,17.3 (default: the top --k induction heads)")
    p.add_argument("--into", type=_into, default=["q", "k", "v"], help="inputs to patch (default q,k,v)")
    p.add_argument("--method", choices=("mean", "zero", "resample"), default="mean",
                   help="mean over the prompts per position (default); zero; resample from another prompt")
    p.add_argument("--attribution", action="store_true",
                   help="estimate the edges by gradients (edge attribution) instead of exact path patching")
    p.add_argument("--k", type=positive_int, default=3, help="induction heads traced without --receivers (3)")
    p.add_argument("--show", type=positive_int, default=3, help="senders listed per receiver input (default 3)")
    json_arg(p, "the result (the trace JSON contract)")
    ray_arg(p, "the scan and the path patching")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .._foundation.heads import model_heads, parse_heads
    from .._paths.path_effects import AGREE, COMPOSITION_VS_RUN
    from .._paths.trace import trace

    if args.ray is not None:
        # The workers load the model; this process loads no weights (receivers are checked by a worker).
        recv = args.receivers
        try:                           # "L.*" needs n_heads, which only a worker knows: it checks those
            parsed = parse_heads(args.receivers) if args.receivers is not None else []
        except QKCircuitsError:
            parsed = []
        bad = [str(r) for r in parsed if r.layer == 0]
        if bad:
            raise QKCircuitsError(f"--receivers: {bad[0]} is in layer 0, which reads no earlier head; name heads of "
                                  f"layer 1 or later")
        model = None
    else:
        model = load_model(args)
        recv = model_heads(model, args.receivers) if args.receivers is not None else None
    if model is not None and recv is not None and any(r.layer == 0 for r in recv):
        raise QKCircuitsError(f"--receivers: {[str(r) for r in recv if r.layer == 0][0]} is in layer 0, which reads "
                              f"no earlier head; name heads of layer 1 or later")
    if args.ray is not None:
        res = trace(args.model, recv, k=args.k, into=args.into, method=args.method, attribution=args.attribution,
                    progress=not args.quiet, backend=ray_backend(args))
        b = res.settings.get("backend")
        if b:
            print(f"  ray: {b['workers']} workers, {b['shards']} shards; start-up {b['startup_s']:.1f} s, load "
                  f"{b['load_s']:.1f} s, path patching {b['patch_s']:.1f} s", file=sys.stderr)
    else:
        res = trace(model, recv, k=args.k, into=args.into, method=args.method, attribution=args.attribution,
                    progress=not args.quiet)
    kind = "edge attribution (gradient estimate)" if res.kind == "attribution" else "exact path patching"
    print(f"{args.model}: {kind}, {args.method} ablation of each sender, over {res.settings.get('n_prompts')} "
          f"prompts x {res.settings.get('n_positions')} tokens; metrics "
          + ", ".join(f"{x}: {res.metrics[x]}" for x in res.into))
    said = False                                 # the sentence on which view to trust: once
    for r in res.receivers:
        for x in res.into:
            print(f"  {res.summary(r, x)}")
            if args.show > 1:
                rest = res.top(args.show, receiver=r, into=x)[1:]
                if rest:
                    print("      next senders (effect): " + ", ".join(f"{s} {e:.3f}" for s, e in rest)
                          + f"; p95 of all senders {res.baseline(r, x)['p95']:.3f}")
        sp = res.k_composition_spearman.get(str(r))
        if sp is not None:
            print(f"      K-path effects vs weights-only K-composition: Spearman {sp:+.2f}")
            if sp < AGREE and not said:
                print(f"      {COMPOSITION_VS_RUN}")
                said = True
    write_output(args.json, res)
    return 0
