"""Parse a GGUF file once per load: ``with parsed_once(): ...`` around the loading code.

Loading one GGUF through transformers reads its header four times: ``load`` checks the file
(``GGUFReader``), then transformers builds the tokenizer, the config and the weights, each with a
``GGUFReader`` of its own; and mapping the weights' names builds gguf's ``TensorNameMap`` (a table
of every tensor name of the architecture) once per module of the model (397 times for SmolLM2).
The header holds the whole tokenizer (SmolLM2: 49,152 tokens and 48,900 merges, each field read as
a numpy view), so these repeats were most of a GGUF load (docs/benchmarks.md, "The main command").

Inside ``parsed_once()`` the first ``GGUFReader(path)`` of each file is kept and handed to later
callers (built over a plain ``ndarray`` view of the file's memory map: every field is a slice of it, and a
slice of ``np.memmap`` runs Python code of its own, which halved the parse), and ``get_tensor_name_map(arch, n_blocks)`` is computed once per pair. Readers are only
read (their tensors are memory-mapped, dequantized into new arrays), so sharing one gives the same
weights, config and tokenizer; the cache and its memory maps are dropped when the block ends.
Not thread-safe (one load at a time in a process, as ``qkcircuits._foundation.lean``).

>>> with parsed_once():
...     pass
"""

from __future__ import annotations

import contextlib
import os
import types
from typing import Dict, Iterator, Tuple

import numpy


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Share GGUF readers and tensor-name maps between the parts of one load (see module docs)."""
    try:
        import gguf
    except ImportError:          # no gguf installed: nothing reads a GGUF file
        yield
        return
    Reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: Dict[Tuple[str, str], object] = {}
    maps: Dict[Tuple[object, int], object] = {}

    def reader(path, mode: str = "r"):
        key = (os.path.realpath(os.fspath(path)), mode)
        if mode != "r":                       # a writable map is not shared
            return Reader(path, mode)
        if key not in readers:
            readers[key] = _plain_reader(Reader, path, mode)
        return readers[key]

    def tensor_name_map(arch, n_blocks):
        key = (arch, int(n_blocks))
        if key not in maps:
            maps[key] = name_map(arch, n_blocks)
        return maps[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, tensor_name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = Reader, name_map
        readers.clear()
        maps.clear()


class _PlainMaps(types.ModuleType):
    """numpy as ``gguf.gguf_reader`` sees it while one reader is built, except that ``memmap`` returns a plain
    ``ndarray`` view of the map (the same bytes, kept mapped through ``.base``)."""

    def __getattr__(self, name: str):
        return getattr(numpy, name)

    @staticmethod
    def memmap(*args, **kwargs):
        return numpy.memmap(*args, **kwargs).view(numpy.ndarray)


def _plain_reader(Reader, path, mode: str):
    from gguf import gguf_reader

    saved = gguf_reader.np
    gguf_reader.np = _PlainMaps("numpy")
    try:
        return Reader(path, mode)
    finally:
        gguf_reader.np = saved
