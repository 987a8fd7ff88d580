"""Ray backend: the sharded sweep equals the local one, survives a killed worker, fails in one line.

One local Ray instance (2 CPUs, no dashboard) is started for the module and shut down after it.
Ground truth: the local ``qk.sweep`` on the same model and prompts (itself tested against the
naive per-head loop in tests/test_ablate.py).
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

from qkcircuits._scale import distributed as dist  # noqa: E402
from qkcircuits._scale import ray_sweep as rsw  # noqa: E402


@pytest.fixture(scope="module")
def ray_local():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = _tiny.llama_dir(tmp_path_factory)
    return folder, qk.load(folder, device="cpu", verbose=False)


def _tokens(model, n=8):
    return qk.repeated_tokens(model, n_seqs=n, seg_len=10, seed=3)


@pytest.mark.parametrize("method", ["mean", "resample"])
def test_ray_sweep_equals_local_sweep(method, llama, ray_local):
    folder, model = llama
    tokens = _tokens(model)
    local = qk.sweep(model, tokens, "induction-loss", method, progress=False)
    # prompts cut into 4 chunks of 2 and layers into groups: mean/resample references must come from
    # the whole prompt set (resample: row i gets row i-1 across chunk borders), not per shard.
    res = rsw.ray_sweep(str(folder), tokens, "induction-loss", method, workers=2, shard_prompts=2, progress=False)
    assert res.backend["shards"] >= 4 and res.backend["workers"] == 2
    assert res.effects.abs().max() > 1e-3                                  # not trivially zero
    torch.testing.assert_close(res.effects, local.effects, atol=1e-5, rtol=0)
    assert abs(res.baseline - local.baseline) < 1e-5
    assert set(res.timing) >= {"startup_s", "load_s", "sweep_s"} and all(v >= 0 for v in res.timing.values())
    assert res.reference == local.reference and res.layers == local.layers
    assert res.settings["fingerprint"] == local.settings["fingerprint"]    # the workers' model is this one (issue 43)


def _killer(job_suffix: str):
    """(state, on_event): counts results and retries of the jobs ending in ``job_suffix`` and SIGKILLs the
    worker of the first dispatch after a result (a worker dies mid-run, once)."""
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
    local = qk.sweep(model, tokens, "induction-loss", "mean", progress=False)
    state, on_event = _killer(":sweep_shard")

    res = rsw.ray_sweep(str(folder), tokens, "induction-loss", "mean", workers=2, shard_prompts=2,
                         progress=False, on_event=on_event)
    assert state["killed"] is not None and state["retries"] == 1 and res.backend["retries"] == 1
    # every shard's result was recorded exactly once ...
    assert sorted(state["results"]) == list(range(res.backend["shards"]))
    # ... and the combined result is the local one
    torch.testing.assert_close(res.effects, local.effects, atol=1e-5, rtol=0)


def test_plan_sweep_covers_every_head_once_and_balances_cost():
    shards, costs = rsw.plan_sweep(100, range(30), 30, 9, n_workers=4, shard_prompts=50)
    seen = [(r, L) for s in shards for r in range(*s["rows"]) for L in s["layers"]]
    assert len(seen) == len(set(seen)) == 100 * 30
    assert len(shards) == 8                                    # 2 prompt chunks x 4 layer groups
    groups = [s["layers"] for s in shards[:4]]
    assert all(g == sorted(g) for g in groups)                 # contiguous layer ranges
    work = [sum(rsw.layer_cost(L, 30, 9) for L in g) for g in groups]
    assert max(work) / min(work) < 1.35                        # equal cost, not equal layer counts
    assert len(groups[0]) < len(groups[-1])                    # early layers cost more per layer


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
    with pytest.raises(QKCircuitsError, match="drop attribution"):
        qk.trace_induction(str(folder), backend="ray", attribution=True)
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
    torch.testing.assert_close(res.effects, local.effects, atol=1e-5, rtol=0)
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
    assert lb["effects"] == la["effects"] and lb["baseline"] == la["baseline"]
    assert max(abs(v) for row in la["effects"] for v in row) > 0.5          # heads 0.0 / 1.0 matter


def test_import_qkcircuits_does_not_import_ray():
    import subprocess

    code = "import sys, qkcircuits; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False"]


# --- path patching on Ray (issue 10's exact path patching, sharded over prompt rows and receiver layers) ----

from qkcircuits._scale import ray_patching as rpp  # noqa: E402


def _assert_same_effects(res, local):
    assert res.receivers == local.receivers and res.into == local.into and res.metrics == local.metrics
    for x in local.into:
        assert torch.equal(res.effects[x].isnan(), local.effects[x].isnan())
        torch.testing.assert_close(res.effects[x], local.effects[x], atol=1e-5, rtol=0, equal_nan=True)
        torch.testing.assert_close(res.clean[x], local.clean[x], atol=1e-5, rtol=0)
    torch.testing.assert_close(res.clean_attention, local.clean_attention, atol=1e-5, rtol=0)


def test_ray_path_patch_equals_local_toy_induction_and_gqa(llama, ray_local):
    """Toy: heads known by training (0.0 feeds 1.0's keys). Tiny GQA Llama, resample: each shard's rows must
    take row i−1's z from the whole prompt set, across shard borders."""
    toy = qk.load("toy-induction", verbose=False)
    toks = qk.repeated_tokens(toy, n_seqs=8, seg_len=8, seed=1)
    local = qk.path_patch(toy, "1.0,1.1", tokens=toks, progress=False)
    res = qk.path_patch("toy-induction", "1.0,1.1", tokens=toks, progress=False, backend="ray", workers=2)
    assert res.settings["backend"]["shards"] == 4 and res.settings["backend"]["workers"] == 2   # 4 row blocks
    _assert_same_effects(res, local)
    assert res.top(1, receiver="1.0", into="k")[0][0] == qk.Head(0, 0) and local.effects["k"][0, 0, 0] > 0.3
    assert json.loads(res.to_json())["receivers"]["1.0"]["clean"] > 0.9            # induction attention

    folder, model = llama
    toks = _tokens(model, 3)
    local = qk.path_patch(model, "1.0,1.3", method="resample", tokens=toks, progress=False)
    res = rpp.ray_path_patch(str(folder), "1.0,1.3", method="resample", tokens=toks, progress=False, workers=2)
    assert res.settings["backend"]["shards"] == 3                                   # 3 rows: one row per shard
    assert local.effects["k"][:, 0].abs().max() > 1e-4                              # not trivially zero
    _assert_same_effects(res, local)


def test_killed_worker_path_patch_shard_reruns_once(llama, ray_local):
    folder, model = llama
    toks = _tokens(model, 4)
    local = qk.path_patch(model, "1.1", into="k,v", tokens=toks, progress=False)
    state, on_event = _killer(":patch_job")          # prepare runs first, on one worker: not counted

    res = rpp.ray_path_patch(str(folder), "1.1", into="k,v", tokens=toks, progress=False, workers=2,
                             on_event=on_event)
    b = res.settings["backend"]
    assert state["killed"] is not None and state["retries"] == 1 and b["retries"] == 1
    assert sorted(state["results"]) == list(range(b["shards"]))     # each shard recorded exactly once
    _assert_same_effects(res, local)


def test_cli_trace_ray_equals_local(tmp_path, ray_local):
    from qkcircuits.cli import main

    a, b = tmp_path / "local.json", tmp_path / "ray.json"
    common = ["trace", "toy-induction", "--k", "2", "--quiet"]
    assert main(common + ["--json", str(a)]) == 0
    assert main(common + ["--ray", "local:2", "--json", str(b)]) == 0
    la, lb = json.loads(a.read_text()), json.loads(b.read_text())
    assert lb["settings"]["backend"]["name"] == "ray" and lb["labels"] == la["labels"]
    assert set(lb["receivers"]) == set(la["receivers"]) == {"1.0", "1.1"}
    for r, d in la["receivers"].items():
        for x in "qkv":
            assert d[x].keys() == lb["receivers"][r][x].keys()
            assert max(abs(v - lb["receivers"][r][x][s]) for s, v in d[x].items()) < 1e-5
        assert abs(d["clean"] - lb["receivers"][r]["clean"]) < 1e-5
        assert d["k_composition_spearman"] == pytest.approx(lb["receivers"][r]["k_composition_spearman"], abs=1e-6)
    assert la["receivers"]["1.0"]["k"]["0.0"] > 0.3                       # the toy's circuit is found


def test_task_scores_and_faithfulness_on_ray_equal_local(llama, ray_local):
    """Edge scores (EAP-IG, exact), exact node scores and the faithfulness curve over prompt shards on one pool
    equal the local ones (tiny Llama-GQA with MLPs): sums over prompts add up, f computed once from them."""
    from qkcircuits._scale import ray_tasks as rt

    folder, model = llama
    base = qk.tasks.induction(model, n=6, seg_len=5, seed=1)
    with torch.no_grad():    # random weights: answer = the clean run's top token, wrong = the corrupt run's
        answer, wrong = model(base.clean)[:, -1].argmax(-1), model(base.corrupt)[:, -1].argmax(-1)
    keep = answer != wrong
    task = qk.Task(base.clean[keep], base.corrupt[keep], answer[keep], wrong[keep])
    assert task.n >= 4
    local = {m: qk.edge_scores(model, task, method=m, progress=False) for m in ("eap-ig", "exact")}
    nodes = qk.node_scores(model, task, method="exact", progress=False)
    faith = qk.faithfulness(model, task, local["eap-ig"], sizes=(1, 10, 50, 100), progress=False)
    assert abs(local["exact"].clean - local["exact"].corrupt) > 0.1              # f's denominator is not tiny
    with dist.Pool(str(folder), workers=2, progress=False) as pool:
        remote = {m: rt.ray_edge_scores(None, task, m, pool=pool, progress=False) for m in local}
        rnodes = rt.ray_node_scores(None, task, "exact", pool=pool, progress=False)
        rfaith = rt.ray_faithfulness(None, task, local["eap-ig"], sizes=(1, 10, 50, 100), pool=pool, progress=False)
        # the core circuit's search on the driver, its node sets measured on the shards; the bootstrap's per-row
        # metrics gathered from the shards in row order
        rcore = rt.ray_core_circuit(None, task, local["eap-ig"], pool=pool, progress=False)
        rboot = rt.ray_faithfulness(None, task, local["eap-ig"], sizes=(1, 10, 50, 100), pool=pool, progress=False,
                                    bootstrap=40, seed=1)
        # the node view alone, m(clean) measured on the shards too (the CLI's --edges path passes it)
        few = faith.circuit.heads[:2]
        rnode = rt.ray_node_faithfulness(pool, task, few)
        # the answer and the wrong token swapped: a task the model does not do warns once, on the driver, from the
        # shards' sums (each shard stays quiet), for edge and node scores alike
        swapped = qk.Task(task.clean, task.corrupt, task.wrong, task.answer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rt.ray_edge_scores(None, swapped, "eap", pool=pool, progress=False)
            rt.ray_node_scores(None, swapped, "exact", pool=pool, progress=False)
            rt.ray_node_scores(None, task, "exact", pool=pool, progress=False)
        assert sum("does not do task" in str(w.message) for w in caught) == 2
    assert rnode == pytest.approx(qk.tasks.node_faithfulness(model, task, few), abs=1e-4)
    for m, res in remote.items():
        assert res.settings["backend"]["shards"] == 4 and res.settings["backend"]["workers"] == 2
        assert sorted(r for p in res.settings["backend"]["plan"] for r in range(*p["rows"])) == list(range(task.n))
        assert torch.equal(res.scores.isnan(), local[m].scores.isnan())
        ref = local[m].scores.nan_to_num()
        assert ref.abs().max() > 1e-2
        torch.testing.assert_close(res.scores.nan_to_num(), ref, atol=1e-5 * float(ref.abs().max()), rtol=1e-4)
        assert res.clean == pytest.approx(local[m].clean, abs=1e-5) and res.corrupt == pytest.approx(local[m].corrupt, abs=1e-5)
    assert rnodes.scores.keys() == nodes.scores.keys()
    assert max(abs(rnodes.scores[k] - v) for k, v in nodes.scores.items()) < 1e-4
    for p, f in faith.curve.items():
        assert rfaith.curve[p] == pytest.approx(f, abs=1e-4), p
    assert rfaith.curve[100.0] == pytest.approx(1.0, abs=1e-6)
    assert (rfaith.cpr, rfaith.cmd) == pytest.approx((faith.cpr, faith.cmd), abs=1e-4)
    assert rfaith.chosen_percent == faith.chosen_percent and rfaith.circuit.heads == faith.circuit.heads
    assert rfaith.node_faithfulness == pytest.approx(faith.node_faithfulness, abs=1e-4)
    core = qk.core_circuit(model, task, local["eap-ig"], progress=False)
    assert (rcore.heads, rcore.mlps) == (core.heads, core.mlps)
    assert rcore.node_faithfulness == pytest.approx(core.node_faithfulness, abs=1e-4)
    assert rcore.curve == pytest.approx(core.curve, abs=1e-4)
    boot = qk.faithfulness(model, task, local["eap-ig"], sizes=(1, 10, 50, 100), progress=False, bootstrap=40, seed=1)
    assert rboot.bootstrap["cpr"] == pytest.approx(boot.bootstrap["cpr"], abs=1e-4)
    for p, interval in boot.bootstrap["curve"].items():
        assert rboot.bootstrap["curve"][p] == pytest.approx(interval, abs=1e-4), p


def test_task_backend_dispatch_reaches_the_ray_jobs(monkeypatch):
    """qk.edge_scores / node_scores / faithfulness(backend=...) hand the request to the Ray implementation with
    the model's spec (no Ray started here: the implementations are replaced by recorders)."""
    from qkcircuits._scale import ray_tasks as rt

    seen = {}

    class Reached(Exception):
        pass

    def recorder(name):
        def fn(spec, **request):
            seen[name] = (spec, request)
            raise Reached(name)
        return fn

    for name in ("ray_edge_scores", "ray_node_scores", "ray_faithfulness", "ray_core_circuit"):
        monkeypatch.setattr(rt, name, recorder(name))
    model = qk.load("toy-induction", verbose=False)
    task = qk.tasks.induction(model, n=2, seg_len=4)
    with pytest.raises(Reached, match="ray_edge_scores"):
        qk.edge_scores(model, task, method="eap", backend="local:3")
    with pytest.raises(Reached, match="ray_node_scores"):
        qk.node_scores(model, task, backend=qk.Ray(workers=2))
    with pytest.raises(Reached, match="ray_faithfulness"):
        qk.faithfulness(model, task, None, sizes=(5, 100), backend="ray")
    with pytest.raises(Reached, match="ray_core_circuit"):
        qk.core_circuit(model, task, None, mlps=False, backend="ray")
    assert seen["ray_core_circuit"][1]["mlps"] is False
    spec, req = seen["ray_edge_scores"]
    assert spec == "toy-induction" and req["task"] is task and req["method"] == "eap"
    assert req["ray_address"] == "local:3" and seen["ray_node_scores"][1]["workers"] == 2
    assert seen["ray_faithfulness"][1]["sizes"] == (5, 100)
    local = qk.edge_scores("toy-induction", task, method="eap", backend="local", progress=False)   # a spec, loaded
    torch.testing.assert_close(local.scores, qk.edge_scores(model, task, method="eap", progress=False).scores,
                               equal_nan=True)
    monkeypatch.undo()
    with pytest.raises(QKCircuitsError, match="unknown edge-score method 'magic'"):
        rt.ray_edge_scores("toy-induction", task, "magic")                        # fails before Ray starts
    with pytest.raises(QKCircuitsError, match="task must be a qk.Task"):
        rt.ray_node_scores("toy-induction", "ioi")


def test_cli_circuit_ray_equals_local(tmp_path, ray_local, capsys):
    from qkcircuits.cli import main

    a, b = tmp_path / "local.json", tmp_path / "ray.json"
    common = ["circuit", "toy-induction", "--task", "induction", "--n", "6", "--method", "exact", "--quiet", "--device",
              "cpu"]
    assert main(common + ["--json", str(a)]) == 0
    assert main(common + ["--ray", "local:2", "--json", str(b)]) == 0
    assert "on Ray, 2 workers" in capsys.readouterr().out
    la, lb = json.loads(a.read_text()), json.loads(b.read_text())
    assert lb["backend"]["name"] == "ray" and lb["backend"]["shards"] == 4 and "backend" not in la
    # the JSON's numbers are exact now: the shards' sums differ from one sum in the last bits (6.1180106e-07 vs
    # 6.1180111e-07 at 10 %)
    assert lb["curve"] == pytest.approx(la["curve"], abs=1e-9)
    assert lb["circuit"]["heads"] == la["circuit"]["heads"] == ["0.0", "1.0"]
    assert lb["clean"] == pytest.approx(la["clean"], abs=1e-4) and lb["cpr"] == pytest.approx(la["cpr"], abs=1e-6)
    assert [e[:3] for e in lb["circuit"]["edges"]] == [e[:3] for e in la["circuit"]["edges"]]
    assert {h: r["role"] for h, r in lb["roles"].items()} == {h: r["role"] for h, r in la["roles"].items()}
    assert lb["core"]["heads"] == la["core"]["heads"] == ["0.0", "1.0"] and lb["roles_of"] == "core"
