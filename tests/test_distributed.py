"""Ray backend: every split analysis (sweep, path patching, edge and node scores) equals the local one EXACTLY
(the same shards, combined by the same function in the same order), on every graph option; a killed worker's shard
runs again once; errors are one line.

One local Ray instance (2 CPUs, no dashboard) is started for the module and shut down after it.
Ground truth: the local functions on the same model and prompts (themselves tested against independent
computations: the naive per-head loop in tests/test_ablate.py, the task tests).
"""

from __future__ import annotations

import json
import os
import signal
import sys

import warnings

import pytest
import torch

import _tiny
import qkcircuits as qk
from qkcircuits import QKCircuitsError
from qkcircuits._foundation import model_cache

ray = pytest.importorskip("ray")

from qkcircuits._analysis import sweep as sw  # noqa: E402
from qkcircuits._foundation import workers as dist  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    if started:
        ray.shutdown()


@pytest.fixture
def one_thread():
    """This process computes with one thread, as each worker does (``qk.Ray(threads=1)``)."""
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(was)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = _tiny.llama_dir(tmp_path_factory)
    return folder, qk.load(folder, device="cpu", verbose=False)


def _tokens(model, n=8):
    return qk.repeated_tokens(model, n_seqs=n, seg_len=10, seed=3)


def _same(a, b):
    """Equal bit for bit (NaN where the other is NaN)."""
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.parametrize("method", ["mean", "resample"])
def test_ray_sweep_equals_local_sweep(method, llama, ray_local):
    folder, model = llama
    tokens = _tokens(model)
    local = qk.sweep(model, tokens, "induction-loss", method, progress=False)
    # layers cut into groups (the plan's, the same on both backends); mean/resample references from the whole
    # prompt set, computed once where the plan runs (one worker)
    res = qk.sweep(str(folder), tokens, "induction-loss", method, progress=False, backend=qk.Ray(workers=2))
    assert res.backend["shards"] >= 2 and res.backend["workers"] == 2
    assert res.effects.abs().max() > 1e-3                                  # not trivially zero
    _same(res.effects, local.effects)
    assert res.baseline == local.baseline
    assert set(res.timing) >= {"startup_s", "load_s", "sweep_s"} and all(v >= 0 for v in res.timing.values())
    assert res.reference == local.reference and res.layers == local.layers
    assert res.settings["fingerprint"] == local.settings["fingerprint"]    # the workers' model is this one (issue 43)


def _killer(job_suffix: str):
    """(state, on_event): counts results and retries of the shard function ending in ``job_suffix`` and SIGKILLs
    the worker of the first dispatch after a result (a worker dies mid-run, once)."""
    state = {"results": [], "killed": None, "retries": 0}

    def on_event(kind, info):
        if not info["job"].endswith(job_suffix):
            return
        if kind == "result":
            state["results"].append(info["shard"])
        elif kind == "retry":
            state["retries"] += 1
        elif kind == "dispatch" and state["results"] and state["killed"] is None:
            state["killed"] = info["pid"]
            os.kill(info["pid"], signal.SIGKILL)
    return state, on_event


def test_killed_worker_shard_reruns_once(llama, ray_local):
    """SIGKILL a worker process right after a shard is dispatched to it, once some shard has finished."""
    folder, model = llama
    tokens = _tokens(model)
    local = qk.path_patch(model, "1.1", into="k,v", tokens=tokens, shards=4, progress=False)
    state, on_event = _killer("_patch_shard_run")          # the plan runs first, on one worker: not counted
    with qk.Ray(workers=2).pool(model) as p:
        p.workers.on_event = on_event
        res = qk.path_patch(model, "1.1", into="k,v", tokens=tokens, shards=4, progress=False, backend=p)
    b = res.settings["backend"]
    assert state["killed"] is not None and state["retries"] == 1 and b["retries"] == 1
    assert sorted(state["results"]) == list(range(b["shards"]))     # each shard recorded exactly once
    _assert_same_effects(res, local)                                # and the combined result is the local one


def test_plan_sweep_covers_every_head_once_and_balances_cost():
    shards, costs = sw.plan_sweep(100, range(30), 30, 9, shard_prompts=50)
    seen = [(r, L) for s in shards for r in range(*s["rows"]) for L in s["layers"]]
    assert len(seen) == len(set(seen)) == 100 * 30
    assert len(shards) == 8                                    # 2 prompt chunks x 4 layer groups
    groups = [s["layers"] for s in shards[:4]]
    assert all(g == sorted(g) for g in groups)                 # contiguous layer ranges
    work = [sum(sw.layer_cost(L, 30, 9) for L in g) for g in groups]
    assert max(work) / min(work) < 1.35                        # equal cost, not equal layer counts
    assert len(groups[0]) < len(groups[-1])                    # early layers cost more per layer
    assert sw.plan_sweep(100, range(30), 30, 9)[0] == sw.plan_sweep(100, range(30), 30, 9)[0]   # no worker count


def test_ray_errors_are_one_line(monkeypatch, llama):
    folder, model = llama
    tokens = _tokens(model, 2)
    with pytest.raises(QKCircuitsError, match=r"cannot reach Ray at '127.0.0.1:9'.*ray start --head.*local:N") as e:
        qk.sweep(str(folder), tokens, backend="ray", ray_address="127.0.0.1:9")
    assert "\n" not in str(e.value)
    with pytest.raises(QKCircuitsError, match="not host:port"):
        qk.sweep(str(folder), tokens, backend="ray", ray_address="nonsense")
    with pytest.raises(QKCircuitsError, match=r"local:N must be a positive integer"):
        qk.sweep(str(folder), tokens, backend="ray", ray_address="local:0")
    # a model that qk.load did not load (here: the spec record removed) has nothing a worker can reload
    bare = qk.load(folder, device="cpu", verbose=False)
    model_cache.forget(bare, "load spec")
    with pytest.raises(QKCircuitsError, match="needs the model's spec.*no reloadable spec") as e:
        qk.sweep(bare, tokens, backend=qk.Ray(workers=2))
    assert "\n" not in str(e.value)
    with pytest.raises(QKCircuitsError, match="unknown backend 'dask'"):
        qk.sweep(model, tokens, backend="dask")
    with pytest.raises(QKCircuitsError, match="needs the model's spec"):
        qk.path_patch(bare, "1.0", backend="ray")
    with pytest.raises(QKCircuitsError, match="ray_address/workers given beside backend=Local"):
        qk.sweep(model, tokens, backend=qk.Local(), ray_address="local:2")
    with pytest.raises(QKCircuitsError, match="unknown backend 'dask'"):
        qk.trace_induction(model, backend="dask")
    # a bad request fails on this process, before Ray starts (no address reachable here)
    task = qk.tasks.induction(model, n=2, seg_len=4)
    with pytest.raises(QKCircuitsError, match="unknown edge-score method 'magic'"):
        qk.edge_scores(str(folder), task, "magic", backend=qk.Ray(address="127.0.0.1:9"))
    with pytest.raises(QKCircuitsError, match="unknown receiver input 'x'"):
        qk.path_patch(str(folder), "1.0", into="x", backend=qk.Ray(address="127.0.0.1:9"))
    with pytest.raises(QKCircuitsError, match="unknown ablation method|method must be"):
        qk.sweep(str(folder), tokens, method="nope", backend=qk.Ray(address="127.0.0.1:9"))
    monkeypatch.setitem(sys.modules, "ray", None)            # as if ray were not installed
    with pytest.raises(QKCircuitsError, match=r"needs the ray package.*pip install 'qkcircuits\[ray\]'"):
        qk.sweep(str(folder), tokens, backend="ray")


def test_a_loaded_model_runs_on_ray_as_its_spec_and_one_pool_serves_every_step(llama, ray_local):
    # ``model`` means the same on both backends: the loaded model travels as the spec qk.load recorded. A
    # qk.Ray pool starts its workers once (each loads the model once) and serves every step given backend=p.
    folder, model = llama
    tokens = _tokens(model, 4)
    local = qk.sweep(model, tokens, "induction-loss", "mean", progress=False)
    local_pp = qk.path_patch(model, "1.0,1.1", "k", tokens=tokens, progress=False)
    with qk.Ray(workers=2).pool(model) as p:
        pids, load_s = list(p.workers.pids), p.workers.timing["load_s"]
        res = qk.sweep(model, tokens, "induction-loss", "mean", progress=False, backend=p)
        pp = qk.path_patch(os.fspath(folder), "1.0,1.1", "k", tokens=tokens, progress=False, backend=p)
        assert p.workers.pids == pids and p.workers.timing["load_s"] == load_s and p.here is None
    assert p.opened == 1 and p.workers is None                  # stopped on exit
    assert res.backend["name"] == "ray" and res.backend["workers"] == 2
    _same(res.effects, local.effects)
    _assert_same_effects(pp, local_pp)
    spec, kwargs = qk._foundation.backends.spec_for_workers(model)
    assert spec == os.fspath(folder) and kwargs["fold_ln"] is True


def test_ray_address_defaults_to_env(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")
    assert dist.Target.parse(None).address == "10.1.2.3:6379"
    monkeypatch.delenv("RAY_ADDRESS")
    assert dist.Target.parse(None) == dist.Target(None, None)
    assert dist.Target.parse("local:3") == dist.Target(None, 3)


def test_cli_ablate_sweep_ray_equals_local(tmp_path, ray_local, capsys):
    from qkcircuits.cli import main

    a, b = tmp_path / "local.json", tmp_path / "ray.json"
    common = ["ablate", "toy-induction", "--sweep", "--n-seqs", "4", "--seg-len", "6", "--quiet", "--method", "mean"]
    assert main(common + ["--json", str(a)]) == 0
    assert main(common + ["--ray", "local:2", "--json", str(b)]) == 0
    la, lb = json.loads(a.read_text()), json.loads(b.read_text())
    assert lb["backend"]["name"] == "ray" and set(lb["timing"]) >= {"startup_s", "load_s", "sweep_s"}
    assert lb["effects"] == la["effects"] and lb["baseline"] == la["baseline"]          # exactly
    assert max(abs(v) for row in la["effects"] for v in row) > 0.5          # heads 0.0 / 1.0 matter


def test_import_qkcircuits_does_not_import_ray():
    import subprocess

    code = "import sys, qkcircuits; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False"]


# --- path patching on Ray (issue 10's exact path patching, sharded over prompt rows and receiver layers) ----


def _assert_same_effects(res, local):
    assert res.receivers == local.receivers and res.into == local.into and res.metrics == local.metrics
    for x in local.into:
        _same(res.effects[x], local.effects[x])
        _same(res.clean[x], local.clean[x])
    _same(res.clean_attention, local.clean_attention)


def test_ray_path_patch_equals_local_toy_induction_and_gqa(llama, ray_local):
    """Toy: heads known by training (0.0 feeds 1.0's keys). Tiny GQA Llama, resample: each shard's rows must
    take row i−1's z from the whole prompt set, across shard borders."""
    toy = qk.load("toy-induction", verbose=False)
    toks = qk.repeated_tokens(toy, n_seqs=8, seg_len=8, seed=1)
    local = qk.path_patch(toy, "1.0,1.1", tokens=toks, shards=4, progress=False)
    res = qk.path_patch("toy-induction", "1.0,1.1", tokens=toks, shards=4, progress=False, backend="ray", workers=2)
    assert res.settings["backend"]["shards"] == 4 and res.settings["backend"]["workers"] == 2   # 4 row blocks
    _assert_same_effects(res, local)
    assert res.top(1, receiver="1.0", into="k")[0][0] == qk.Head(0, 0) and local.effects["k"][0, 0, 0] > 0.3
    assert json.loads(res.to_json())["receivers"]["1.0"]["clean"] > 0.9            # induction attention

    folder, model = llama
    toks = _tokens(model, 3)
    local = qk.path_patch(model, "1.0,1.3", method="resample", tokens=toks, shards=3, progress=False)
    res = qk.path_patch(str(folder), "1.0,1.3", method="resample", tokens=toks, shards=3, progress=False,
                        backend=qk.Ray(workers=2))
    assert res.settings["backend"]["shards"] == 3                                   # 3 rows: one row per shard
    assert local.effects["k"][:, 0].abs().max() > 1e-4                              # not trivially zero
    _assert_same_effects(res, local)


def test_cli_trace_ray_equals_local(tmp_path, ray_local):
    from qkcircuits.cli import main

    a, b = tmp_path / "local.json", tmp_path / "ray.json"
    common = ["trace", "toy-induction", "--k", "2", "--quiet"]
    assert main(common + ["--json", str(a)]) == 0
    assert main(common + ["--ray", "local:2", "--json", str(b)]) == 0
    la, lb = json.loads(a.read_text()), json.loads(b.read_text())
    assert lb["settings"].pop("backend")["name"] == "ray" and "backend" not in la["settings"]
    for d in (la, lb):
        d.pop("timing", None)
    assert lb == la                                                        # every number, exactly
    assert set(la["receivers"]) == {"1.0", "1.1"} and la["receivers"]["1.0"]["k"]["0.0"] > 0.3   # the toy's circuit


def _llama_task(model):
    base = qk.tasks.induction(model, n=6, seg_len=5, seed=1)
    with torch.no_grad():    # random weights: answer = the clean run's top token, wrong = the corrupt run's
        answer, wrong = model(base.clean)[:, -1].argmax(-1), model(base.corrupt)[:, -1].argmax(-1)
    keep = answer != wrong
    task = qk.Task(base.clean[keep], base.corrupt[keep], answer[keep], wrong[keep], positions=dict(
        (k, v[keep]) for k, v in base.positions.items()))
    assert task.n >= 4
    return task


@pytest.mark.parametrize("graph", [{}, {"gqa": "ungrouped"}, {"positions": True}], ids=["grouped", "ungrouped",
                                                                                      "positions"])
def test_task_scores_and_faithfulness_on_ray_equal_local(graph, llama, ray_local, one_thread):
    """Edge scores (EAP-IG, exact), exact node scores, the faithfulness curve and the core circuit on one Ray pool
    equal the local ones bit for bit, on the grouped, ungrouped and position-aware graphs (tiny Llama-GQA with
    MLPs): the same prompt-row shards, their float64 sums added in the same order."""
    folder, model = llama
    task = _llama_task(model)
    kw = dict(rows_per_shard=2, progress=False, **graph)
    local = {m: qk.edge_scores(model, task, method=m, **kw) for m in ("eap-ig", "exact")}
    nodes = qk.node_scores(model, task, method="exact", **kw)
    # the curve's circuit metrics in 3 row blocks too (CIRCUIT_METRIC), on Ray over both workers
    faith = qk.faithfulness(model, task, local["eap-ig"], sizes=(1, 10, 50, 100), rows_per_shard=2, progress=False,
                            bootstrap=20)
    with qk.Ray(workers=2).pool(model) as p:
        remote = {m: qk.edge_scores(model, task, method=m, backend=p, **kw) for m in local}
        rnodes = qk.node_scores(model, task, method="exact", backend=p, **kw)
        rfaith = qk.faithfulness(model, task, local["eap-ig"], sizes=(1, 10, 50, 100), rows_per_shard=2,
                                 progress=False, bootstrap=20, backend=p)
        if not graph.get("positions"):
            core = qk.core_circuit(model, task, local["eap-ig"], progress=False)
            rcore = qk.core_circuit(model, task, local["eap-ig"], progress=False, backend=p)
            assert (rcore.heads, rcore.mlps, rcore.curve) == (core.heads, core.mlps, core.curve)
        # the answer and the wrong token swapped: a task the model does not do warns once, from the shards' sums
        swapped = qk.Task(task.clean, task.corrupt, task.wrong, task.answer, positions=task.positions)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            qk.edge_scores(model, swapped, method="eap", backend=p, **kw)
            qk.node_scores(model, swapped, method="exact", backend=p, **kw)
            qk.node_scores(model, task, method="exact", backend=p, **kw)
        assert sum("does not do task" in str(w.message) for w in caught) == 2
    for m, res in remote.items():
        assert res.settings.pop("backend")["shards"] == 3 and "backend" not in local[m].settings
        assert res.scores.nan_to_num().abs().max() > 1e-2
        _same(res.scores, local[m].scores)
        if graph.get("positions"):
            _same(res.position_scores, local[m].position_scores)
        assert (res.clean, res.corrupt, res.settings) == (local[m].clean, local[m].corrupt, local[m].settings)
    assert rnodes.scores == nodes.scores
    assert (rfaith.curve, rfaith.cpr, rfaith.cmd, rfaith.bootstrap) == (faith.curve, faith.cpr, faith.cmd,
                                                                          faith.bootstrap)
    assert rfaith.circuit.heads == faith.circuit.heads and rfaith.node_faithfulness == faith.node_faithfulness
    assert rfaith.metric_values == faith.metric_values
    assert (rfaith.clean, rfaith.corrupt) == (faith.clean, faith.corrupt)


def test_cli_circuit_ray_equals_local(tmp_path, ray_local, capsys):
    from qkcircuits.cli import main

    a, b = tmp_path / "local.json", tmp_path / "ray.json"
    # one thread here as on each worker (--threads: the workers' too): the core's search breaks ties of equal costs
    # by float order, and a matrix product's rounding may depend on the thread count
    common = ["circuit", "toy-induction", "--task", "induction", "--n", "6", "--method", "exact", "--quiet", "--device",
              "cpu", "--threads", "1"]
    assert main(common + ["--json", str(a)]) == 0
    assert main(common + ["--ray", "local:2", "--json", str(b)]) == 0
    assert "on Ray, 2 workers" in capsys.readouterr().out
    la, lb = json.loads(a.read_text()), json.loads(b.read_text())
    assert lb.pop("backend")["name"] == "ray" and "backend" not in la
    assert lb["summary"].pop(0) == la["summary"].pop(0) + "; on Ray, 2 workers"      # the first line says where
    for d in (la, lb):                      # how long each step took: the only numbers that may differ
        d.pop("timing"), d["core"].pop("seconds")
    assert lb == la                                                       # every number, exactly
    assert la["circuit"]["heads"] == ["0.0", "1.0"] and la["core"]["heads"] == ["0.0", "1.0"]


def test_cli_circuit_graph_options_on_ray_equal_local(tmp_path, ray_local, capsys):
    """``--gqa ungrouped --positions`` on Ray (refused before issue 44 ask 1): the local command's JSON."""
    from qkcircuits.cli import main

    a, b = tmp_path / "local.json", tmp_path / "ray.json"
    common = ["circuit", "toy-induction", "--task", "induction", "--n", "6", "--method", "eap", "--quiet", "--device",
              "cpu", "--threads", "1", "--gqa", "ungrouped", "--positions"]
    assert main(common + ["--json", str(a)]) == 0
    assert main(common + ["--ray", "local:2", "--json", str(b)]) == 0
    la, lb = json.loads(a.read_text()), json.loads(b.read_text())
    assert lb.pop("backend")["name"] == "ray" and la["graph"]["positions"] == ["END", "other"]
    lb["summary"].pop(0), la["summary"].pop(0)
    la.pop("timing"), lb.pop("timing")
    assert lb == la
