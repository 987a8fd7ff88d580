"""Arguments and helpers shared by the subcommands."""

from __future__ import annotations

import argparse

from .._foundation.io import check_writable, write_atomic  # noqa: F401  (re-exported for the subcommands)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="hub name, local Hugging Face folder, .gguf file, or 'smollm2-135m'")
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    p.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    p.add_argument("--no-fold-ln", action="store_true", help="keep raw Hugging Face weights (no LayerNorm folding)")


def load_model(args):
    from .._foundation.model import load

    return load(args.model, device=args.device, dtype=args.dtype, fold_ln=not args.no_fold_ln)


def _int_at_least(least: int, words: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"expected a {words} integer, got {text!r}")
        return value
    return parse


positive_int = _int_at_least(1, "positive")
non_negative_int = _int_at_least(0, "non-negative")
