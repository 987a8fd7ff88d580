"""``qkcircuits zoo MODEL [MODEL ...]``: scan every model and compare their induction circuits."""

from __future__ import annotations

import argparse

from ._common import html_arg, input_arg, json_arg, non_negative_int, positive_int, ray_arg, write_output


def add_parser(sub) -> None:
    p = sub.add_parser("zoo", help="scan several models and compare where their induction heads sit",
                       description="Scan every model (induction and previous-token scores, plus a causal check) "
                                   "and write one comparison: JSON and a side-by-side HTML figure.")
    input_arg(p, "models", nargs="+", metavar="MODEL",
                   help="hub names, local Hugging Face folders, .gguf files, 'smollm2-135m', 'toy-induction'")
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    p.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    p.add_argument("--confirm", type=non_negative_int, default=5, metavar="K",
                   help="ablate the top-K induction heads together against random K-head sets (default 5; 0: skip)")
    p.add_argument("--n-seqs", type=positive_int, default=8, help="sequences of [BOS]+R+R per model (default 8)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="seed of the prompt sets (default 0)")
    ray_arg(p, "one model per worker")
    p.add_argument("--task", default=None, metavar="NAME",
                   help="also find each model's circuit of this registered task (ioi, greater-than, ...: "
                        "qk.tasks.task_names()): its metric, CPR/CMD, roles (IOI: name movers)")
    p.add_argument("--task-n", type=positive_int, default=32, metavar="N",
                   help="prompts of the --task (default 32)")
    p.add_argument("--bos", choices=("auto", "yes", "no"), default="auto",
                   help="BOS before each --task prompt: auto (default) = what each model's tokenizer does on its "
                        "own, yes / no = forced")
    json_arg(p, "the comparison as JSON")
    html_arg(p, "the comparison")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .._foundation.model import check_spec
    from .._scale.zoo import zoo

    for spec in args.models:          # every spec before the first model loads
        check_spec(spec)
    if args.task is not None:
        from .._tasks.registry import task_spec

        task_spec(args.task)          # a registered task (a .jsonl file is `qkcircuits circuit`'s)
    z = zoo(args.models, backend="ray" if args.ray is not None else "local", ray_address=args.ray or None,
            confirm_k=args.confirm, n_seqs=args.n_seqs, seed=args.seed, progress=not args.quiet,
            load_kwargs={"device": args.device, "dtype": args.dtype}, task=args.task, task_n=args.task_n,
            task_bos={"auto": None, "yes": True, "no": False}[args.bos])
    print(format_zoo(z.models, args.task))
    write_output(args.json, z)
    if args.output:
        from ..viz._zoo import zoo_html

        write_output(args.output, zoo_html(z))
    return 0


def format_zoo(models, task=None) -> str:
    from .._scale.zoo import confirmation_verdict

    lines = [f"{'model':<28}{'shape':>8}  {'induction heads (top 3: score@depth)':<48}  {'prev-token (top 2)':<32}  "
             f"causal check"]
    for m in models:
        ind = ", ".join(f"{h['head']} {h['score']:.2f}@{h['depth']:.2f}" for h in m["induction"][:3]) or (
            f"none (best {m['strongest']['induction']['head']} {m['strongest']['induction']['score']:.2f})")
        prev = ", ".join(f"{h['head']} {h['score']:.2f}@{h['depth']:.2f}" for h in m["previous_token"][:2]) or (
            f"none (best {m['strongest']['previous_token']['head']})")
        c = m["confirmation"]
        conf = "-" if not c else f"{c['effect']:+.2f} vs random max {c['random_max']:+.2f}: {confirmation_verdict(c)}"
        shape = f"{m['n_layers']}x{m['n_heads']}"
        lines.append(f"{m['model'][-27:]:<28}{shape:>8}  {ind:<48}  {prev:<32}  {conf}")
    for m in models:
        ks = m.get("k_sources")
        if ks:     # which earlier head each induction head's keys read (None: no sender above the p95)
            lines.append(f"  {m['model'][-27:]} K sources: " + ", ".join(f"{r}<-{s or '?'}" for r, s in ks.items()))
    task_lines = [format_task(m, task) for m in models if task is not None and task in m]
    if task_lines:
        lines += [f"{task} (the task's metric clean / corrupt; faithfulness of the EAP-IG circuit; name movers: "
                  f"direct share of the metric's difference, END -> IO attention)"] + task_lines
    return "\n".join(lines)


def format_task(m, task: str) -> str:
    t = m[task]
    name = m["model"][-27:]
    if "skipped" in t:
        return f"  {name}: skipped ({t['skipped']})"
    movers = ", ".join(f"{h['head']} {h['direct_share']:.2f}/{h['END->IO']:.2f}" for h in t["name_movers"][:5])
    values = t.get("values") or t["logit_diff"]          # older files: logit_diff only
    return (f"  {name}: {t.get('metric', 'logit-diff')} {values['clean']:+.2f} / {values['corrupt']:+.2f}; CPR "
            f"{t['cpr']:.3f}, CMD {t['cmd']:.3f}; " + _circuit_words(t) + f"; name movers {movers or 'none'}")


def _circuit_words(t) -> str:
    """The entry's circuit, or why none is named (older files: every circuit was named)."""
    if not t.get("circuit_named", True):
        return ("no circuit named (" + ("the model does not do the task" if not t.get("does_task", True) else
                                        "no size below 100% reaches f >= 0.8") + ")")
    return (f"circuit {t['chosen_percent']:g}% ({t['circuit_edges']} edges, {t['circuit_heads']} heads, node f "
            f"{t['node_faithfulness']:.2f})")
