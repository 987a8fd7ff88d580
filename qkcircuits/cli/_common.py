"""Arguments and helpers shared by the subcommands."""

from __future__ import annotations

import argparse

from .._io import check_writable, write_atomic  # noqa: F401  (re-exported for the subcommands)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="hub name, local Hugging Face folder, .gguf file, or 'smollm2-135m'")
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    p.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    p.add_argument("--no-fold-ln", action="store_true", help="keep raw Hugging Face weights (no LayerNorm folding)")


def load_model(args):
    from .._model import load

    return load(args.model, device=args.device, dtype=args.dtype, fold_ln=not args.no_fold_ln)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value
