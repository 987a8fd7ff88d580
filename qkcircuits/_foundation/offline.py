"""``hub_offline()``: while the block runs, huggingface_hub answers from local files only (no 20 s of retries for a
local load). Its own module because ``model`` (loading) and ``own_tokenizer`` (reloading a checkpoint's tokenizer)
both need it, and ``model`` imports ``own_tokenizer``.

>>> import os
>>> with hub_offline():
...     os.environ["HF_HUB_OFFLINE"]
'1'
"""

from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def hub_offline():
    """Make huggingface_hub answer from local files only (no 20 s of retries for local loads)."""
    import huggingface_hub.constants as hc

    old_env, old_const = os.environ.get("HF_HUB_OFFLINE"), hc.HF_HUB_OFFLINE
    os.environ["HF_HUB_OFFLINE"] = "1"
    hc.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hc.HF_HUB_OFFLINE = old_const
        if old_env is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old_env
