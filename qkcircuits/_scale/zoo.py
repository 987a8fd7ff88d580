"""Scan many models and compare where their induction and previous-token heads sit.

>>> z = zoo(["toy-induction"], progress=False)                     # one model at a time
>>> z.models[0]["induction"]                                        # the toy's one induction head
[{'head': '1.0', 'score': 0.9999996, 'depth': 0.5}]
>>> text = z.to_json(tmp / "zoo.json")
>>> z = zoo(["smollm2-135m", "toy-induction"], backend="ray")     # doctest: +SKIP (needs Ray and SmolLM2)

Per model (``ZOO_KEYS`` are fixed): its induction and previous-token heads (score at least the
scan's threshold, 0.4; best first, at most ``k``), each head's relative depth
``layer / n_layers``, the strongest head of each kind even below the threshold, the causal check
(``confirmation``: the repeated-half loss rise when the top-k induction heads are zero-ablated
together, and the largest rise among k-head random sets), and ``k_sources``: which earlier
head feeds each listed induction head's keys, by exact path patching into K (``k_sources``):
``{"18.6": "16.0"}`` = the top K-path sender, kept when its effect is above that receiver's
95th percentile over all its senders, else ``null`` for that head (and for layer-0 heads).

With ``task=NAME``, a registered task (``qkcircuits zoo --task ioi``; ``qk.tasks.task_names()``), each entry also
gets the key NAME (``task_summary``): the task's metric (its name, clean and corrupt means over ``task_n``
prompts; ``logit_diff`` too where the metric is logit-diff), the faithfulness curve of its EAP-IG circuit with
CPR/CMD, the chosen circuit's size and node view (``circuit_named`` false, its size 0 and no roles, when the model
does not do the task or no size below 100 % reaches f ≥ 0.8: as ``qk.find_circuit``, which computes the entry
without the core and the held-out part), its role counts and name movers (``roles``; IOI's), each with its
direct effect and END → IO / END → S attention; ``{"skipped": reason}`` for a model the task cannot be built for
(no tokenizer, too few single-token words).

Memory: one loaded model at a time per process (locally the previous one is released before the
next loads); with Ray each worker loads the models of the shards it runs, one at a time.
"""

from __future__ import annotations

import gc
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._foundation.backends import BackendLike, Local, Ray, as_backend
from .._analysis.detectors import detector
from .._foundation.errors import QKCircuitsError
from .._foundation.io import check_int, json_floats, json_number
from .._foundation.result import Result
from .._foundation.stats import versus_random

SCHEMA = "qkcircuits.zoo/1"
# The detectors a zoo entry lists heads of (their names are JSON keys; thresholds come from the registry).
ZOO_DETECTORS = ("induction", "previous_token")
ZOO_KEYS = ("model", "n_layers", "n_heads", *ZOO_DETECTORS, "confirmation", "k_sources")
K_SOURCES_NOTE = ("k_sources: per listed induction head, the earlier head with the largest K-path effect (exact "
                  "path patching into its keys, mean ablation, the scan's prompts) when that effect is above the "
                  "receiver's 95th percentile over all senders; null: no sender stands out (or a layer-0 head)")


@dataclass(frozen=True, repr=False)      # the repr is _text (Result)
class Zoo(Result):
    """One summary dict per model (``ZOO_KEYS`` plus ``name``, ``fingerprint``, ``strongest``, ``scores``, ``timing_s``)."""

    SCHEMA = SCHEMA
    WHAT = "a 'qkcircuits zoo --json' output"
    KEYS = ("models",)

    models: List[Dict[str, Any]]
    settings: Dict[str, Any] = field(default_factory=dict)
    timing: Dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return {"schema": SCHEMA, "models": self.models, "settings": self.settings, "timing": self.timing,
                "notes": {"k_sources": K_SOURCES_NOTE}}

    @classmethod
    def _from_dict(cls, d: Dict[str, Any]) -> "Zoo":
        if not isinstance(d.get("models"), list):
            raise QKCircuitsError("not a qkcircuits zoo JSON: no 'models' list")
        return cls(d["models"], d.get("settings", {}), d.get("timing", {}))

    def top(self, k: int = 5, kind: str = "induction") -> List[Tuple[str, float]]:
        """The ``k`` highest-scoring listed heads of ``kind`` over all models: ``("model L.H", score)``."""
        rows = [(f"{m['model']} {h['head']}", float(h["score"])) for m in self.models for h in m.get(kind, [])]
        return sorted(rows, key=lambda r: -r[1])[:k]

    def _text(self) -> str:
        parts = [f"{m['model']}: {len(m.get('induction', []))} induction, {len(m.get('previous_token', []))} "
                 f"previous-token" for m in self.models[:5]]
        more = f"; ... {len(self.models) - 5} more" if len(self.models) > 5 else ""
        return f"Zoo({len(self.models)} models; " + "; ".join(parts) + more + ")"

    def to_frame(self):
        """One row per (model, head kind, head): model, kind, head, layer, score, depth."""
        import pandas as pd

        rows = [{"model": m["model"], "kind": kind, **h, "layer": int(h["head"].split(".")[0])}
                for m in self.models for kind in ZOO_DETECTORS for h in m[kind]]
        return pd.DataFrame(rows, columns=["model", "kind", "head", "layer", "score", "depth"])


def confirmation_verdict(c: Dict[str, Any]) -> str:
    """A zoo entry's causal check against its random sets, in words (``stats.random_verdict``'s): "above random
    (z = 12.3)" or "WARNING: within the random sets' spread (margin +0.18 < SD 0.43, z = 1.4)"; an entry written
    before the SD was recorded says so."""
    if c.get("clear") is None or c.get("random_sd") is None:
        return "no verdict (no spread of the random sets recorded)"
    margin, sd, z = float(c["effect"]) - float(c["random_max"]), float(c["random_sd"]), c.get("z")
    zt = f"z = {float(z):.1f}" if isinstance(z, (int, float)) else "z = inf"
    if c["clear"]:
        return f"above random (margin {margin:+.3f} > SD {sd:.3f}, {zt})"
    return f"WARNING: within the random sets' spread (margin {margin:+.3f} <= SD {sd:.3f}, {zt})"


def summarise(spec: str, scores, *, k: int = 10) -> Dict[str, Any]:
    """The zoo entry of one model from its ``HeadScores`` (with ``extras["confirmation"]`` when checked)."""
    L, H = scores.n_layers, scores.n_heads
    out: Dict[str, Any] = {"model": spec, "name": scores.model, "n_layers": L, "n_heads": H}
    if scores.settings.get("fingerprint"):           # the model's fingerprint (``_foundation/fingerprint``)
        out["fingerprint"] = scores.settings["fingerprint"]
    strongest = {}
    for kind in ZOO_DETECTORS:
        score, minimum = kind, detector(kind).threshold
        ranked = scores.top(L * H, score)
        heads = [_head(h, v, L) for h, v in ranked if v >= minimum][:k]
        out[kind] = heads
        strongest[kind] = _head(*ranked[0], L)
    out["strongest"] = strongest
    conf = scores.extras.get("confirmation")
    vs = None if conf is None else versus_random(float(conf["effect"]), conf["random_effects"])
    out["confirmation"] = None if conf is None else {
        "effect": json_number(conf["effect"]), "random_max": json_number(max(conf["random_effects"])),
        "random_mean": json_number(sum(conf["random_effects"]) / len(conf["random_effects"])),
        "heads": conf["heads"], "n_draws": len(conf["random_effects"]), "baseline": json_number(conf["baseline"]),
        "random_sd": json_number(vs["sd"]), "z": json_number(vs["z"]), "clear": vs["clear"]}
    out["k_sources"] = None
    out["scores"] = {k: json_floats(scores[k]) for k in ZOO_DETECTORS}
    return out


def _head(head, value: float, n_layers: int) -> Dict[str, Any]:
    import torch

    # a scan's scores are float32: the shortest decimal of that float32 (exact, and as the "scores" grids write it)
    return {"head": str(head), "score": json_floats(torch.tensor(value, dtype=torch.float32)),
            "depth": round(head.layer / n_layers, 4)}


def scan_one(spec: str, *, load_kwargs: Optional[Dict[str, Any]] = None, confirm_k: int = 5, n_seqs: int = 8,
             seed: int = 0, k: int = 10, model=None, task: Optional[str] = None,
             task_n: int = 32, task_bos: Optional[bool] = None) -> Dict[str, Any]:
    """Load ``spec`` (unless ``model`` is given), scan it with the causal check, summarise, release it."""
    from .._analysis.detect import scan
    from .._foundation.model import load

    t0 = time.perf_counter()
    own = model is None
    if own:
        model = load(spec, verbose=False, **(load_kwargs or {}))
    t1 = time.perf_counter()
    confirm = min(confirm_k, max(0, (model.cfg.n_layers * model.cfg.n_heads) // 2))
    # only the scores the zoo reports: one streamed pass over [BOS]+R+R (plus the causal check)
    scores = scan(model, scores=list(ZOO_DETECTORS), n_seqs=n_seqs, seed=seed, confirm_k=confirm,
                  progress=False)
    out = summarise(spec, scores, k=k)
    t2 = time.perf_counter()
    out["k_sources"] = k_sources(model, [h["head"] for h in out["induction"]], n_seqs=n_seqs, seed=seed)
    out["timing_s"] = {"load": round(t1 - t0, 3), "scan": round(t2 - t1, 3),
                       "k_sources": round(time.perf_counter() - t2, 3)}
    if task is not None:
        t3 = time.perf_counter()
        out[task] = task_summary(model, task, n=task_n, seed=seed, prepend_bos=task_bos)
        out["timing_s"][task] = round(time.perf_counter() - t3, 3)
    if own:
        del model
        gc.collect()
    return out


def k_sources(model, heads: Sequence[str], *, n_seqs: int = 8, seed: int = 0) -> Dict[str, Optional[str]]:
    """For each induction head in ``heads``: the sender with the largest K-path effect (``path_patch`` into
    "k", mean ablation, every earlier head as sender, on the scan's kind of prompts ``default_prompts``)
    when that effect is above the receiver's 95th percentile over all its senders, else None (also for a
    layer-0 head, which reads no earlier head). ``{}`` when ``heads`` is empty.

    >>> k_sources(model, ["1.0"])             # the toy's induction head reads its keys from 0.0
    {'1.0': '0.0'}

    Memory and cost: as ``path_patch`` for these receivers and K only (one attention layer per sender).
    """
    from .._foundation.heads import Head
    from .._paths.patching import default_prompts, path_patch

    out: Dict[str, Optional[str]] = {h: None for h in heads}
    recv = [Head.parse(h) for h in heads if Head.parse(h).layer > 0]
    if not recv:
        return out
    res = path_patch(model, recv, into=("k",), tokens=default_prompts(model, n_seqs, seed), progress=False)
    for r in recv:
        top = res.top(1, receiver=r, into="k")
        if top and top[0][1] > res.baseline(r, "k")["p95"]:
            out[str(r)] = str(top[0][0])
    return out


def task_summary(model, name: str, *, n: int = 32, seed: int = 0, method: str = "eap-ig", steps: int = 5,
                 prepend_bos: Optional[bool] = None) -> Dict[str, Any]:
    """The zoo's entry for the registered task ``name`` on one loaded model: the task built by the registry
    (``n`` prompts, ``seed``, ``prepend_bos``: None = what the model's tokenizer does on its own), EAP-IG edge
    scores, the faithfulness curve (MIB grid) with CPR/CMD, the chosen circuit (smallest size with f ≥ 0.8) and its
    node view, its role counts and the name movers among its roles (largest direct effect first; none when the
    model does not do the task: ``roles`` refuses). ``{"skipped": reason}`` when the task cannot be built for this
    model. Cost: as ``qkcircuits circuit MODEL --task NAME --n n``."""
    from .._tasks.find import find_circuit

    bos = {None: "auto", True: "yes", False: "no"}[prepend_bos]
    try:           # the command's pipeline, as the zoo always ran it: no core, no held-out part
        report = find_circuit(model, name, n=n, seed=seed, bos=bos, method=method, steps=steps, core=False,
                              holdout=0, progress=False)
    except QKCircuitsError as e:           # the task cannot be built for this model (e.g. a name is not one token)
        return {"skipped": str(e)}
    d = report.data
    movers = sorted(((h, r["evidence"]) for h, r in d["roles"].items() if r["role"] == "name mover"),
                    key=lambda t: -float(t[1]["direct_effect"]))
    counts: Dict[str, int] = {}
    for r in d["roles"].values():
        counts[str(r["role"])] = counts.get(str(r["role"]), 0) + 1
    values = {"clean": d["clean"], "corrupt": d["corrupt"]}
    faith_circuit = d["circuit"]
    return {"task": name, "n_prompts": d["n_prompts"], "method": method, "steps": steps, "rule": d["rule"],
            "bos": d["bos"], "metric": d["metric"], "values": values,
            **({"logit_diff": values} if d["metric"] == "logit-diff" else {}),
            "does_task": d["does_task"], "circuit_named": faith_circuit["named"], "curve": d["curve"], "cpr": d["cpr"], "cmd": d["cmd"],
            "chosen_percent": d["chosen_percent"], "circuit_edges": faith_circuit["n_edges"],
            "circuit_heads": len(faith_circuit["heads"]), "node_faithfulness": faith_circuit["node_faithfulness"],
            "name_movers": [{"head": h, "direct_effect": e["direct_effect"], "direct_share": e["direct_share"],
                             "END->IO": e["END->IO"], "END->S": e["END->S"]} for h, e in movers],
            "roles": dict(sorted(counts.items()))}


def zoo_job(model, shared, scratch, **kwargs) -> Dict[str, Any]:
    """One model on a Ray worker that holds none (a shard of ``Pool.map``): ``scan_one`` loads this shard's."""
    return scan_one(**kwargs)


def zoo_entry(model, *, spec: str, **kwargs) -> Dict[str, Any]:
    """The step "zoo_entry" in this process: ``scan_one`` on the pool's loaded ``model`` (a backend's pool runs it)."""
    return scan_one(spec, model=model, **kwargs)


def zoo(specs: Sequence[str], *, backend: BackendLike = "local", ray_address: Optional[str] = None,
        workers: Optional[int] = None, confirm_k: int = 5, n_seqs: int = 8, seed: int = 0, k: int = 10,
        load_kwargs: Optional[Dict[str, Any]] = None, progress: bool = True, task: Optional[str] = None,
        task_n: int = 32, task_bos: Optional[bool] = None) -> Zoo:
    """Scan every model in ``specs`` (as for ``qk.load``) and collect one comparison: per detector at most
    ``k`` heads over its threshold.

    ``backend``: ``qk.Local()`` (default), ``qk.Ray(address=..., workers=...)`` or any ``qk.Backend`` (strings as
    ``qk.as_backend``). On Ray: one model per shard on Ray workers (``ray_address`` as in ``sweep``; at most
    one worker per model), handed out in the given order as workers free up (put the largest
    model first). Any other backend: one ``backend.pool(spec)`` per model, in turn (the model loaded once, its
    scan, K sources and task on it: the step ``"zoo_entry"``); ``load_kwargs`` reach ``qk.Local``'s and
    ``qk.Ray``'s loads (another backend loads as it does). ``confirm_k``: induction heads ablated together for the causal check (0: none).
    ``task``: None, or a registered task's name (``"ioi"``): each entry also gets that key (``task_summary`` on
    ``task_n`` prompts, BOS as ``task_bos``: None = what each model's tokenizer does on its own, True / False forced).
    The ``settings`` JSON keys are ``confirm_top`` and ``max_heads`` (old files and readers agree).
    """
    models = specs
    chosen = as_backend(backend, address=ray_address, workers=workers)
    if isinstance(models, str) or not models:
        raise QKCircuitsError("zoo needs a list of one or more model specs, e.g. ['smollm2-135m', 'toy-induction']")
    check_int("n_seqs", n_seqs)
    check_int("confirm_k", confirm_k, 0)
    check_int("task_n", task_n)
    if task is not None:
        from .._tasks.registry import task_spec

        task_spec(task)                      # a registered task (one line naming them otherwise)
        if task in ZOO_KEYS or task in ("name", "strongest", "scores", "timing_s", "fingerprint"):
            raise QKCircuitsError(f"zoo task {task!r} has the name of an entry's own key; register it under another")
    load_kwargs = dict(load_kwargs or {})
    if isinstance(chosen, Local):            # the zoo's load options, under the backend's own
        chosen = replace(chosen, load_kwargs={**load_kwargs, **chosen.load_kwargs})
    elif load_kwargs and not isinstance(chosen, Ray):
        raise QKCircuitsError(f"load_kwargs={load_kwargs!r} beside backend={chosen!r}: that backend loads the models "
                              f"as it does; give it the options itself")
    from .._foundation.model import check_spec

    for m in models:                     # every spec checked before the first model loads
        check_spec(m)
    kwargs = dict(confirm_k=confirm_k, n_seqs=n_seqs, seed=seed, k=k, task=task, task_n=task_n, task_bos=task_bos)
    settings = {"confirm_top": confirm_k, "n_seqs": n_seqs, "seed": seed, "max_heads": k,
                **({"task": task, "task_n": task_n, "task_method": "eap-ig, 5 steps, left rule",
                    "task_bos": {None: "auto", True: "yes", False: "no"}[task_bos]} if task else {}),
                "thresholds": {k: detector(k).threshold for k in ZOO_DETECTORS}, "depth": "layer / n_layers",
                "backend": chosen.name}
    t0 = time.perf_counter()
    if isinstance(chosen, Ray):       # one pool of workers for every model: one model per shard, models in parallel
        from .._foundation.workers import Pool

        with Pool(None, workers=chosen.workers, threads=chosen.threads, max_workers=len(models),
                  address=chosen.address, progress=progress) as pool:
            kwargs["load_kwargs"] = {**load_kwargs, **chosen.load_kwargs}
            entries = pool.map(zoo_job, [{"spec": str(m), **kwargs} for m in models], desc="zoo")
            timing = {"startup_s": pool.timing["startup_s"], "scan_s": pool.timing["run_s"]}
    else:                             # any other backend: one pool per model (loaded once), its steps on it
        from .._foundation.progress import progress_bar

        entries = [_entry_on(chosen, str(m), kwargs)
                   for m in progress_bar(list(models), desc="zoo", unit="model", enabled=progress)]
        timing = {"scan_s": time.perf_counter() - t0}
    timing["total_s"] = time.perf_counter() - t0
    return Zoo(entries, settings, {k: round(v, 3) for k, v in timing.items()})


def _entry_on(backend, spec: str, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """One model's zoo entry on ``backend``'s pool (the model loaded on open, released on close: one model alive
    at a time); the pool's open counts into the entry's load time."""
    t0 = time.perf_counter()
    with backend.pool(spec) as pool:
        opened = time.perf_counter() - t0
        entry = pool.run("zoo_entry", local=zoo_entry, spec=spec, **kwargs)
    gc.collect()
    entry["timing_s"]["load"] = round(entry["timing_s"]["load"] + opened, 3)
    return entry
