"""Foundation: errors, I/O, loading, heads, prompt sets, attention internals and hooks. Private: the public API is re-exported by ``qkcircuits``."""

# Before anything here imports transformers / TransformerLens (which import tqdm.auto): in a Jupyter kernel without
# ipywidgets that import would print "TqdmWarning: IProgress not found" into the notebook (progress.py).
from .progress import quiet_tqdm_auto as _quiet

_quiet()
