"""Arguments and helpers shared by the subcommands, and the one check that no output names an input.

Every file a subcommand reads or writes is declared once, where its argument is added: ``input_arg`` and
``output_arg`` wrap ``add_argument`` and record the argument's ``dest`` on the parser; ``add_model_args``
declares the model. ``check_paths(args)`` (called by ``cli.main`` before any work) refuses, with one line
and exit 2, an output that is one of the inputs (the same file, a hard link to it, a file inside an input
folder), two outputs of one run that are the same file, and an empty output path. Arguments with the usual
names (``INPUT_NAMES``/``OUTPUT_NAMES``) are checked even when a command adds them with plain ``add_argument``.

>>> p = argparse.ArgumentParser()
>>> add_model_args(p)
>>> _ = output_arg(p, "--json")
>>> check_paths(p.parse_args([str(tmp / "m.gguf"), "--json", str(tmp / "out.json")]))
>>> (tmp / "m.gguf").write_text("x")
1
>>> check_paths(p.parse_args([str(tmp / "m.gguf"), "--json", str(tmp / "m.gguf")]))
Traceback (most recent call last):
...
qkcircuits._foundation.errors.QKCircuitsError: --json ... is the model file ...; an output must not replace an input: give another path
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Iterator, List, Tuple

from .._foundation.errors import QKCircuitsError
from .._foundation.io import check_writable, write_atomic

# Argument names (dest) that always name files read / written, whichever command adds them.
INPUT_NAMES = ("model", "models", "scores", "ablation", "diagnostics", "trace", "task", "circuit", "attend")
OUTPUT_NAMES = ("json", "csv", "output")
# Model specs that are not paths but stand for a cached file.
_CACHED_SPECS = ("smollm2-135m", "smollm2")


def _declared(parser: argparse.ArgumentParser, key: str) -> List[str]:
    names = list(parser.get_default(key) or [])
    return names


def _declare(parser: argparse.ArgumentParser, key: str, dest: str) -> None:
    names = _declared(parser, key)
    if dest not in names:
        parser.set_defaults(**{key: names + [dest]})


def input_arg(parser: argparse.ArgumentParser, *flags: str, **kwargs) -> argparse.Action:
    """``parser.add_argument(*flags, **kwargs)`` for a file the command reads (never to be overwritten)."""
    action = parser.add_argument(*flags, **kwargs)
    _declare(parser, "_qk_inputs", action.dest)
    return action


def output_arg(parser: argparse.ArgumentParser, *flags: str, **kwargs) -> argparse.Action:
    """``parser.add_argument(*flags, **kwargs)`` for a file the command writes."""
    action = parser.add_argument(*flags, **kwargs)
    _declare(parser, "_qk_outputs", action.dest)
    return action


def metric_arg(flag: str, choices: Tuple[str, ...], prompts: Tuple[str, ...]):
    """The ``type=`` of a ``--metric`` flag: a name among ``choices`` (names of the one metric table,
    ``_foundation/metric_table``); anything else is one argparse error line naming what is accepted (exit 2)."""

    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"unknown metric {text!r}; use one of {', '.join(choices)}")
        return text

    parse.__name__ = "metric"           # argparse names the type in its own messages
    return parse


def add_model_args(p: argparse.ArgumentParser) -> None:
    input_arg(p, "model", help="hub name, local Hugging Face folder, .gguf file, or 'smollm2-135m'")
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps")
    p.add_argument("--dtype", default=None, help="float32 (default), bfloat16, float16")
    p.add_argument("--no-fold-ln", action="store_true", help="keep raw Hugging Face weights (no LayerNorm folding)")


def _flag(dest: str) -> str:
    return dest if dest in ("model", "models") else "--" + dest.replace("_", "-")


def _values(args: argparse.Namespace, dest: str) -> Iterator[str]:
    value = getattr(args, dest, None)
    for v in (value if isinstance(value, (list, tuple)) else [value]):
        if v is not None:
            yield os.fspath(v)


def _input_files(dest: str, value: str) -> Iterator[Tuple[str, Path]]:
    """(what, resolved path) for the files an input value stands for: itself if it exists, the cached GGUF of
    an alias."""
    what = "the model file" if dest in ("model", "models") else f"the {_flag(dest)} file"
    if dest in ("model", "models") and value.lower() in _CACHED_SPECS:
        from .._foundation.fetch import smollm2_target

        yield "the cached model file", smollm2_target().resolve()
        return
    p = Path(value).expanduser()
    if p.exists():
        yield (what if p.is_file() else what.replace(" file", " folder")), p.resolve()


def _same(a: Path, b: Path) -> bool:
    if a == b:
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_paths(args: argparse.Namespace) -> None:
    """Refuse (``QKCircuitsError``) an output that names an input or another output, or is empty; then check
    each output can be written. Cheap: nothing is read."""
    ins = list(dict.fromkeys([*INPUT_NAMES, *(getattr(args, "_qk_inputs", None) or [])]))
    outs = list(dict.fromkeys([*OUTPUT_NAMES, *(getattr(args, "_qk_outputs", None) or [])]))
    inputs = [(_flag(d), v, what, p) for d in ins for v in _values(args, d) for what, p in _input_files(d, v)]
    seen: List[Tuple[str, str, Path]] = []
    for dest in outs:
        for value in _values(args, dest):
            flag = _flag(dest)
            if not value.strip():
                raise QKCircuitsError(f"{flag} is empty; give the path of the file to write")
            out = Path(value).expanduser().resolve()
            for _, in_value, what, p in inputs:
                if _same(out, p) or (p.is_dir() and out.exists() and p in out.parents):
                    where = f"is {what} {in_value!r}" if _same(out, p) else f"is inside {what} {in_value!r}"
                    raise QKCircuitsError(f"{flag} {value!r} {where}; an output must not replace an input: give "
                                          f"another path")
            for o_flag, o_value, o in seen:
                if _same(out, o):
                    raise QKCircuitsError(f"{o_flag} {o_value!r} and {flag} {value!r} name the same file; the second "
                                          f"would replace the first: give two paths")
            check_writable(value)
            seen.append((flag, value, out))


def output_paths(args: argparse.Namespace) -> List[Path]:
    """Every file this run writes (its declared outputs: ``OUTPUT_NAMES`` and ``output_arg`` flags): ``cli.main``
    commits them as one set (``io.output_set``)."""
    outs = list(dict.fromkeys([*OUTPUT_NAMES, *(getattr(args, "_qk_outputs", None) or [])]))
    return [Path(v).expanduser() for d in outs for v in _values(args, d) if v.strip()]


# ------------------------------------------------------------------------------------------ common flags, once
RAY_FORMS = ("an address (host:port, ray://...), local:N (a local instance with N one-thread workers), or nothing "
             "($RAY_ADDRESS, else a local instance)")


def ray_arg(p: argparse.ArgumentParser, what: str) -> argparse.Action:
    """``--ray [ADDRESS|local:N]``: ``what`` (e.g. "the sweep") runs on Ray workers that each load the model once;
    ``ray_backend(args)`` is the backend it names."""
    return p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS|local:N",
                          help=f"run {what} on Ray workers that each load the model once: {RAY_FORMS}")


def ray_backend(args: argparse.Namespace):
    """The ``qk.Ray`` backend of ``--ray`` (its address, ``--threads`` per worker, default 1) with the model flags
    (what each worker loads)."""
    from .._foundation.backends import Ray

    return Ray(address=args.ray or None, threads=getattr(args, "threads", None) or 1, load_kwargs=load_kwargs(args))


def load_kwargs(args: argparse.Namespace) -> dict:
    """``qk.load``'s options from the model flags (``add_model_args``)."""
    return {"device": args.device, "dtype": args.dtype, "fold_ln": not args.no_fold_ln}


def json_arg(p: argparse.ArgumentParser, what: str) -> argparse.Action:
    """``--json PATH``: write ``what`` (one of the run's outputs: ``write_output``)."""
    return output_arg(p, "--json", metavar="PATH", help=f"write {what}")


def html_arg(p: argparse.ArgumentParser, what: str, required: bool = False) -> argparse.Action:
    """``-o/--output HTML``: write ``what`` as one offline HTML file."""
    return output_arg(p, "-o", "--output", metavar="HTML", required=required,
                      help=f"write {what} as one offline HTML file")


def timing_arg(p: argparse.ArgumentParser, what: str = "each step") -> argparse.Action:
    """``--timing``: print how long ``what`` took (the JSON keeps it under ``timing``)."""
    return p.add_argument("--timing", action="store_true", help=f"print how long {what} took (also in the JSON's timing)")


def write_output(path, content, note: str = "") -> None:
    """One output of the run, when its flag was given (``path`` not None): a result (its ``to_json``), a dict (JSON,
    non-finite numbers as null) or text (HTML, CSV), written atomically; then ``wrote PATH`` on stderr. ``cli.main``
    commits the run's outputs as one set. ``note``: said after the path (e.g. the file's size)."""
    if not path:
        return
    from .._foundation.io import dump_json

    if isinstance(content, dict):
        dump_json(content, str(Path(path).expanduser()))
    elif isinstance(content, str):
        write_atomic(str(Path(path).expanduser()), content)
    else:                                 # a Result: its own JSON (schema first)
        content.to_json(str(Path(path).expanduser()))
    print(f"wrote {path}{note}", file=sys.stderr)


def add_threads_arg(p: argparse.ArgumentParser) -> None:
    """``--threads N`` (every command that runs torch; ``cli.main`` applies it before the command runs)."""
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="CPU threads torch uses (default: what torch chooses, torch.get_num_threads(): usually the "
                        "machine's physical cores; on a shared machine fewer can be faster)")


HEAD_FLAGS = ("head", "heads", "receivers")     # argument dests naming heads, checked before the model loads


def check_shape(args: argparse.Namespace) -> None:
    """Refuse a ``--head`` / ``--heads`` / ``--receivers`` outside the model's shape, read from its files' metadata
    (``_foundation/shape``: config.json, the GGUF header) before any weight loads, so a typo such as ``--head 18.60``
    fails in a second. A model whose shape cannot be read cheaply is checked after loading, as before."""
    given = [(d, getattr(args, d)) for d in HEAD_FLAGS if isinstance(getattr(args, d, None), str)]
    spec = getattr(args, "model", None)
    if not given or not isinstance(spec, str):
        return
    from .._foundation.heads import check_heads, parse_heads
    from .._foundation.shape import read_shape

    shape = read_shape(spec)
    if shape is None:
        return
    L, H = shape
    for dest, value in given:
        try:
            check_heads(parse_heads(value, n_heads=H), L, H)
        except QKCircuitsError as e:
            raise QKCircuitsError(f"{_flag(dest)} {value!r}: {e}") from None


def load_model(args):
    from .._foundation.model import load

    return load(args.model, device=args.device, dtype=args.dtype, fold_ln=not args.no_fold_ln)


MAX_INT_DIGITS = 18     # an integer argument has at most this many digits (a 5,000-digit one is one line)


def short(text: str, n: int = 40) -> str:
    """``text`` cut to ``n`` characters for an error line."""
    return text if len(text) <= n else text[:n] + "..."


def bounded_int(text: str) -> int:
    """``int(text)`` for an argument of at most ``MAX_INT_DIGITS`` digits; else ``ValueError`` naming it."""
    digits = text.strip().lstrip("+-")
    if len(digits) > MAX_INT_DIGITS:
        raise ValueError(f"{short(text)!r} has {len(digits)} digits; at most {MAX_INT_DIGITS}")
    return int(text)


def _int_at_least(least: int, words: str):
    def parse(text: str) -> int:
        try:
            value = bounded_int(text)
        except ValueError:
            value = least - 1
        if value < least:
            many = len(text.strip().lstrip("+-")) > MAX_INT_DIGITS
            raise argparse.ArgumentTypeError(f"expected a {words} integer, got {short(text)!r}"
                                             + (f" (at most {MAX_INT_DIGITS} digits)" if many else ""))
        return value
    return parse


def int_arg(text: str) -> int:
    """The ``type=`` of an integer flag (``--seed``): at most ``MAX_INT_DIGITS`` digits."""
    try:
        return bounded_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer (at most {MAX_INT_DIGITS} digits), got "
                                         f"{short(text)!r}") from None


int_arg.__name__ = "integer"


def head_arg(text: str) -> str:
    """The ``type=`` of a ``--head``/``--heads``/``--receivers`` flag: the spec's syntax, digit counts and range
    sizes are checked at parse time (``heads.check_head_spec``: exit 2 before the model loads); the command
    checks it against the model's shape by its ends (``model_heads``) before anything is built."""
    from .._foundation.heads import check_head_spec

    try:
        return check_head_spec(text)
    except QKCircuitsError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


head_arg.__name__ = "head"


positive_int = _int_at_least(1, "positive")
non_negative_int = _int_at_least(0, "non-negative")
