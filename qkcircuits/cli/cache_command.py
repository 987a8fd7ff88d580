"""``qkcircuits cache [show|clear]``: what the model cache holds (and whether it is verified), or delete it."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser("cache", help="show or clear the model cache (the SmolLM2 GGUF, checked by sha256)",
                       description="Show the cache folder ($QKCIRCUITS_CACHE, else ~/.cache/qkcircuits), its files and "
                                   "whether the SmolLM2 GGUF matches the pinned sha256; 'clear' deletes the folder "
                                   "(the next 'smollm2-135m' fetches the model again).")
    p.add_argument("action", nargs="?", choices=("show", "clear"), default="show", help="show (default) or clear")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .._foundation.fetch import cache_info, clear_cache

    if args.action == "clear":
        freed = clear_cache()
        print(f"cleared {cache_info()['folder']} ({freed / 2 ** 20:.1f} MiB)")
        return 0
    info = cache_info()
    print(f"cache folder: {info['folder']}" + ("" if info["files"] else " (empty)"))
    for f in info["files"]:
        state = "" if "verified" not in f else ("  sha256 OK" if f["verified"] else
                                                "  sha256 MISMATCH: run `qkcircuits cache clear`")
        print(f"  {f['path']}  {f['bytes'] / 2 ** 20:.1f} MiB{state}")
    return 0
