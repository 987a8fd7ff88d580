"""A GGUF file's dequantized checkpoint, kept once per file content so the next load skips the conversion.

>>> folder = converted(path)          # doctest: +SKIP (needs a GGUF): None the first time
>>> store(path, hf_model, tokenizer)  # doctest: +SKIP (needs a GGUF): after the first conversion

Loading a GGUF parses its header (the tokenizer's vocabulary: ~3.5 s for SmolLM2) and dequantizes every tensor
through transformers (~3 s) on every command. ``store`` writes what that conversion gave, as a Hugging Face folder
in safe formats only (``model.safetensors``, ``config.json``, the tokenizer's JSON files; never a pickle), to
``<cache>/converted/<sha256 of the GGUF>/``; ``converted`` finds it again for a file with the same sha256, so a
renamed or copied GGUF hits it and an edited one does not. The folder is written under a temporary name and renamed
into place (an interrupted write leaves nothing a later load would read; two processes racing keep one). Only a
float32 conversion is stored (what ``qk.load`` gives by default); a load at another dtype reads it and casts, as
transformers does for the GGUF itself. Disk: the float32 weights (SmolLM2-135M: 538 MB); ``qkcircuits cache clear``
deletes it with the rest of the cache. The file's sha256 is remembered beside the conversion's index by size and
modification time (``_hash``), so an unchanged file is hashed once.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from . import model_cache
from .fetch import cache_dir, sha256_file

FORMAT = 1          # bump when what is stored changes: older folders are then ignored


def root() -> Path:
    return cache_dir() / "converted"


def _hash(path: Path) -> str:
    """The GGUF's sha256, read from ``root()/hashes.json`` when the file's path, size and mtime match a record."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    index = root() / "hashes.json"
    try:
        known = json.loads(index.read_text(encoding="utf-8"))
        if isinstance(known, dict) and isinstance(known.get(key), str):
            return known[key]
    except (OSError, ValueError):
        known = {}
    digest = sha256_file(path)
    try:
        root().mkdir(parents=True, exist_ok=True)
        known = known if isinstance(known, dict) else {}
        known[key] = digest
        tmp = index.with_name(f".hashes.{os.getpid()}.json")
        tmp.write_text(json.dumps(known), encoding="utf-8")
        os.replace(tmp, index)
    except OSError:            # a read-only cache: hash again next time
        pass
    return digest


def converted(path: Path) -> Optional[Path]:
    """The stored conversion of the GGUF at ``path`` (a Hugging Face folder), or None."""
    try:
        folder = root() / _hash(Path(path))
        done = json.loads((folder / "qkcircuits-converted.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if done.get("format") != FORMAT or not (folder / "model.safetensors").is_file():
        return None
    return folder


def store(path: Path, hf_model, tokenizer) -> Optional[Path]:
    """Write the float32 conversion of the GGUF at ``path`` (its transformers model and tokenizer) into the cache;
    the folder, or None when it was not stored (another dtype, no space, a read-only cache: the load goes on)."""
    import torch

    if any(p.dtype != torch.float32 for p in hf_model.parameters()):
        return None
    try:
        digest = _hash(Path(path))
        target = root() / digest
        if target.exists():
            return target
        root().mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:12]}.", dir=root()))
        try:
            # transformers refuses save_pretrained on a model loaded from a GGUF (marked quantized): the weights
            # are written by safetensors (tied ones once, as from_pretrained expects), the config as JSON
            from safetensors.torch import save_model

            save_model(hf_model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            cfg = hf_model.config.to_dict()
            cfg.pop("quantization_config", None)
            cfg["architectures"] = cfg.get("architectures") or [type(hf_model).__name__]
            (tmp / "config.json").write_text(json.dumps(cfg, indent=1, default=str), encoding="utf-8")
            tokenizer.save_pretrained(tmp)
            for p in tmp.iterdir():       # safe formats only: weights as safetensors, the rest JSON / text
                if p.suffix in (".bin", ".pt", ".pkl", ".pth"):
                    p.unlink()
            (tmp / "qkcircuits-converted.json").write_text(json.dumps({"format": FORMAT, "gguf": str(path),
                                                                      "sha256": digest}), encoding="utf-8")
            os.rename(tmp, target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not target.exists():
                raise
        return target
    except OSError:
        return None


class Processed:
    """The folded weights of one converted GGUF (``lean.fold_in_place(bridge, store=...)``): TransformerLens's
    ``ProcessWeights.process_weights`` output, kept as ``processed-<key>.safetensors`` in the conversion's folder,
    the key naming the dtype, the processing options and the TransformerLens / transformers / torch versions.
    ``load`` gives it back only when the input it was made from has the same keys, shapes and dtypes (its metadata
    records them); anything else (a damaged file, another TransformerLens) is ignored and the weights are
    processed as usual."""

    def __init__(self, folder: Path, dtype) -> None:
        self.folder, self.dtype = Path(folder), str(dtype).replace("torch.", "")

    def _file(self, options) -> Path:
        import hashlib

        from importlib.metadata import version

        try:
            versions = [version(p) for p in ("transformer-lens", "transformers", "torch")]
        except Exception:  # noqa: BLE001
            versions = ["?"]
        key = json.dumps([FORMAT, self.dtype, sorted((k, repr(v)) for k, v in options.items()
                                                      if k != "adapter"), versions])
        return self.folder / f"processed-{hashlib.sha256(key.encode()).hexdigest()[:16]}.safetensors"

    @staticmethod
    def _signature(state_dict) -> str:
        import torch

        return json.dumps([[k, list(v.shape), str(v.dtype)] for k, v in state_dict.items()
                           if isinstance(v, torch.Tensor)])

    def load(self, state_dict, options):
        self._input = self._signature(state_dict)          # what ``save`` records the output was made from
        path = self._file(options)
        if not path.is_file():
            return None
        try:
            from safetensors import safe_open
            from safetensors.torch import load_file

            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            if meta.get("input") != self._input:
                return None
            order = json.loads(meta["order"])
            got = load_file(str(path))
            return {k: got.pop(k) for k in order}
        except Exception:  # noqa: BLE001  an unreadable file: process as usual
            return None

    def save(self, state_dict, options) -> None:
        import torch

        if not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
            return
        path = self._file(options)
        if path.exists() or not hasattr(self, "_input"):
            return
        try:
            from safetensors.torch import save_file

            seen, out = set(), {}
            for k, v in state_dict.items():      # safetensors stores each storage once: a shared one is copied
                ptr = v.untyped_storage().data_ptr()
                out[k] = v.detach().contiguous() if ptr not in seen else v.detach().clone().contiguous()
                seen.add(ptr)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            save_file(out, str(tmp), metadata={"input": self._input, "order": json.dumps(list(state_dict))})
            os.replace(tmp, path)
        except (OSError, RuntimeError, ValueError):
            pass


# which cached conversion a loaded bridge came from (its folded weights are kept beside it): a record in the
# model's store (model_cache), dropped with the bridge
def remember(bridge, folder) -> None:
    """Record that ``bridge`` was loaded from the cached conversion ``folder``."""
    model_cache.remember(bridge, "gguf conversion", folder)


def converted_of(bridge):
    """The cached conversion ``bridge`` was loaded from, or None."""
    return model_cache.recall(bridge, "gguf conversion")
