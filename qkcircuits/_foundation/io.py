"""Small shared helpers for inputs and outputs: integer checks, atomic file writes, JSON numbers.

>>> check_int("n_seqs", 8)
8
>>> json_number(float("nan")) is None
True
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Union

from .errors import QKCircuitsError

# Read once at import: flipping the process umask later to read it would race with other threads.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def check_int(name: str, value, least: int = 1) -> int:
    """``value`` if it is an integer (not a bool) ``>= least``; else a one-line ``QKCircuitsError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise QKCircuitsError(f"{name} must be an integer >= {least}, got {value!r}")
    return value


def check_writable(path: Union[str, Path]) -> Path:
    """Fail early (before minutes of work) when ``path`` cannot be written: missing folder, a folder itself."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise QKCircuitsError(f"cannot write {str(path)!r}: it is a folder; give a file path")
    if not target.parent.is_dir():
        raise QKCircuitsError(f"cannot write {str(path)!r}: folder {str(target.parent)!r} does not exist")
    if not os.access(target.parent, os.W_OK):
        raise QKCircuitsError(f"cannot write {str(path)!r}: folder {str(target.parent)!r} is not writable")
    return target


def write_atomic(path: Union[str, Path], text: str) -> None:
    """Write ``text`` through a temporary file in the same folder and rename it: the whole file or none.

    The file gets the usual permissions (0666 less the umask), not mkstemp's private 0600.
    """
    target = check_writable(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise QKCircuitsError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def json_number(x) -> Optional[float]:
    """A float for JSON: NaN and infinities become ``null``; others rounded to 6 decimals."""
    x = float(x)
    return None if math.isnan(x) or math.isinf(x) else round(x, 6)


def dump_json(data: Dict[str, Any], path: Optional[Union[str, Path]] = None, indent: int = 1) -> str:
    """JSON text of ``data``, also written atomically to ``path`` when given."""
    text = json.dumps(data, indent=indent)
    if path is not None:
        write_atomic(path, text)
    return text


def load_json(text_or_path: Union[str, Path], what: str) -> Dict[str, Any]:
    """Parse JSON text, or the file at a path; ``what`` names the expected producer in the error."""
    text = str(text_or_path)
    if not text.lstrip().startswith("{"):
        p = Path(text).expanduser()
        if not p.is_file():
            raise QKCircuitsError(f"no JSON file at {text!r}; pass JSON text or the path of {what}")
        text = p.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except ValueError as e:
        raise QKCircuitsError(f"{str(text_or_path)[:80]!r} is not valid JSON ({e}); expected {what}") from None


def package_version(dist: str) -> str:
    """The installed version of distribution ``dist`` (e.g. "transformer-lens", which has no ``__version__``),
    or "not installed"."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"
