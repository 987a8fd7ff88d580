"""Arguments and helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from .._errors import QKCircuitsError


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


def write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder: whole file or none."""
    target = Path(path)
    if not target.parent.exists():
        raise QKCircuitsError(f"cannot write {path!r}: folder {str(target.parent)!r} does not exist")
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; results are meant to be shared
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
