"""A model's shape (layers, heads) read from its files' metadata, before any weight loads: what the CLI checks its
``--head`` / ``--heads`` / ``--receivers`` against, so a typo fails in a second instead of after the load.

>>> import json
>>> (tmp / "m").mkdir()
>>> _ = (tmp / "m" / "config.json").write_text(json.dumps({"num_hidden_layers": 30, "num_attention_heads": 9}))
>>> read_shape(str(tmp / "m"))
(30, 9)
>>> read_shape("no-such-model") is None            # a hub name not in the local cache: unknown, checked after loading
True

Where the shape comes from: a Hugging Face folder's ``config.json`` (``num_hidden_layers``/``n_layer``/``num_layers``,
``num_attention_heads``/``n_head``/``num_heads``, or a ``text_config`` holding them); a ``.gguf`` file's header
(``{architecture}.block_count``, ``{architecture}.attention.head_count``: only the key-value header is read, up to
those two keys, never the tensors); ``smollm2-135m`` from its cached GGUF; ``toy-induction`` (2 x 2); a hub name
from the hub's local cache only (no network). Anything else gives None and the check happens after loading, as
before.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Optional, Tuple

Shape = Tuple[int, int]
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "n_heads")


def read_shape(spec: object) -> Optional[Shape]:
    """(n_layers, n_heads) of ``spec`` from metadata alone, or None when it cannot be read cheaply."""
    if not isinstance(spec, (str, os.PathLike)):
        return None
    text = os.fspath(spec)
    try:
        if text.lower() == "toy-induction":
            return (2, 2)
        if text.lower() == "smollm2-135m":
            from .fetch import smollm2_target

            target = smollm2_target()
            return gguf_shape(target) if target.is_file() else None
        path = Path(text).expanduser()
        if path.is_file() and path.suffix.lower() == ".gguf":
            return gguf_shape(path)
        if path.is_dir():
            if (path / "config.json").is_file():
                return config_shape(path / "config.json")
            ggufs = sorted(path.glob("*.gguf"))
            return gguf_shape(ggufs[0]) if len(ggufs) == 1 else None
        if path.exists() or text.count("/") > 1:
            return None
        return _hub_cached(text)
    except (OSError, ValueError, KeyError, struct.error, UnicodeDecodeError):
        return None           # unreadable metadata: the load says what is wrong with the file


def config_shape(path: Path) -> Optional[Shape]:
    cfg = json.loads(Path(path).read_text())
    for c in (cfg, cfg.get("text_config") or {}):
        layers = next((c[k] for k in _LAYERS if isinstance(c.get(k), int)), None)
        heads = next((c[k] for k in _HEADS if isinstance(c.get(k), int)), None)
        if layers and heads:
            return (int(layers), int(heads))
    return None


# GGUF value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array, 10 u64, 11 i64, 12 f64
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_INTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


def gguf_shape(path: Path) -> Optional[Shape]:
    """(block_count, attention.head_count) from a GGUF file's key-value header (version 2 or 3), reading keys in
    order until both are found; arrays (the tokenizer's vocabulary) are skipped without decoding."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            return None
        version, = struct.unpack("<I", f.read(4))
        if version < 2:
            return None
        _, n_kv = struct.unpack("<QQ", f.read(16))
        found = {}
        arch = None

        def string() -> str:
            n, = struct.unpack("<Q", f.read(8))
            return f.read(n).decode("utf-8")

        def skip(kind: int) -> None:
            if kind == 8:
                n, = struct.unpack("<Q", f.read(8))
                f.seek(n, 1)
            elif kind == 9:
                elem, count = struct.unpack("<IQ", f.read(12))
                if elem in _SIZES:
                    f.seek(_SIZES[elem] * count, 1)
                else:
                    for _ in range(count):
                        skip(elem)
            else:
                f.seek(_SIZES[kind], 1)

        for _ in range(n_kv):
            key = string()
            kind, = struct.unpack("<I", f.read(4))
            if key == "general.architecture" and kind == 8:
                arch = string()
            elif kind in _INTS and key.endswith((".block_count", ".attention.head_count")):
                found[key], = struct.unpack(_INTS[kind], f.read(_SIZES[kind]))
            else:
                skip(kind)
            if arch and f"{arch}.block_count" in found and f"{arch}.attention.head_count" in found:
                return (int(found[f"{arch}.block_count"]), int(found[f"{arch}.attention.head_count"]))
    return None


def _hub_cached(name: str) -> Optional[Shape]:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    got = try_to_load_from_cache(name, "config.json")
    return config_shape(Path(got)) if isinstance(got, str) and Path(got).is_file() else None
