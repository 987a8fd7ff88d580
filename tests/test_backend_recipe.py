"""The docs' "How to add a backend" recipe, executed (issue 36 asks 5 and 9).

The backend is the one docs/architecture.md defines: its block is read from the page and run here, unchanged. It
runs steps where its model is and maps a split analysis' shards LAST FIRST (issue 44 ask 1: a backend only maps
shards). It must serve every command with ONE pool per command (the model loaded once): the split analyses
(edge and node scores on every graph option, the sweep, path patching), ``qk.zoo`` (one pool per model), the
circuit steps in Python (an open pool as ``backend=``), and the ``circuit`` command's own steps (task, edge
scores, core, curve, sign check, ``--edges`` circuit, roles). Ground truth: the local backend (no backend at all,
and ``qkcircuits circuit`` as the CLI runs it) on the same model and prompts; the results must be EQUAL, bit for
bit (the same shards combined by the same function in the same order; only the order they ran in differs).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import _tiny
import qkcircuits as qk
from qkcircuits import QKCircuitsError

DOCS = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


@pytest.fixture(scope="module")
def recipe():
    """The namespace of the recipe's first python block, run as the page shows it."""
    page = DOCS.read_text(encoding="utf-8")
    section = page[page.index("### How to add a backend"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "class Recording(qk.Backend)" in code and "def pool(self, model)" in code and "def each(" in code
    ns = {"qk": qk}
    exec(compile(code, "docs/architecture.md (How to add a backend)", "exec"), ns)
    return ns


@pytest.fixture(scope="module")
def toy_task():
    model = qk.load("toy-induction", verbose=False)
    return model, qk.tasks.induction(model, n=6, seg_len=5, seed=1)


def _same(a, b):
    torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


def test_zoo_runs_each_model_on_one_pool_of_the_recipe_backend(recipe, tmp_path_factory):
    llama = str(_tiny.llama_dir(tmp_path_factory))
    specs = ["toy-induction", llama]
    backend = recipe["Recording"]()
    got = qk.zoo(specs, backend=backend, confirm_k=1, n_seqs=2, progress=False)
    want = qk.zoo(specs, confirm_k=1, n_seqs=2, progress=False)
    assert backend.opened == specs and backend.ran == ["zoo_entry", "zoo_entry"]      # one pool, one step per model
    for a, b in zip(got.models, want.models, strict=True):
        assert {k: v for k, v in a.items() if k != "timing_s"} == {k: v for k, v in b.items() if k != "timing_s"}
        assert a["timing_s"].keys() == b["timing_s"].keys()
    assert got.models[0]["k_sources"] == {"1.0": "0.0"}                              # the toy's circuit, found
    assert got.settings == {**want.settings, "backend": "recording"} and want.settings["backend"] == "local"
    with pytest.raises(QKCircuitsError, match="load_kwargs=.*beside backend=.*give it the options itself"):
        qk.zoo(specs, backend=backend, load_kwargs={"dtype": "bfloat16"}, progress=False)


def test_circuit_steps_share_one_pool_and_equal_the_local_backend(recipe, toy_task, hand_built):
    model, task = toy_task
    backend = recipe["Recording"]()
    with backend.pool("toy-induction") as p:              # a spec: the pool loads it, once, for every step
        scores = qk.edge_scores("toy-induction", task, method="eap", backend=p, progress=False)
        nodes = qk.node_scores(p.model, task, method="exact", backend=p, progress=False)
        faith = qk.faithfulness("toy-induction", task, scores, sizes=(5, 20, 50, 100), backend=p, progress=False)
        core = qk.core_circuit("toy-induction", task, scores, backend=p, progress=False)
        # another model (the same weights, built without qk.load: no spec to match) is refused in one line
        with pytest.raises(QKCircuitsError, match=r"backend= is a pool of 'toy-induction', not of a Transf") as e:
            qk.edge_scores(hand_built, task, backend=p)
        assert "\n" not in str(e.value)
    assert backend.opened == ["toy-induction"] and p.opened == 1
    # the split analyses' plans are steps named after them; their shards went through each()
    assert backend.ran == ["edge_scores", "node_scores", "faithfulness", "node_view", "core_circuit"]
    assert [job for job, _ in backend.mapped] == ["edge_scores", "node_scores", "faithfulness"]
    with pytest.raises(QKCircuitsError, match="is closed"):
        qk.edge_scores("toy-induction", task, backend=p)

    local = qk.edge_scores(model, task, method="eap", progress=False)
    _same(scores.scores, local.scores)
    assert (scores.clean, scores.corrupt) == (local.clean, local.corrupt) and scores.clean > scores.corrupt
    assert nodes.scores == qk.node_scores(model, task, method="exact", progress=False).scores
    lf = qk.faithfulness(model, task, local, sizes=(5, 20, 50, 100), progress=False)
    assert faith.curve == lf.curve and (faith.cpr, faith.cmd) == (lf.cpr, lf.cmd)
    assert faith.circuit.heads == lf.circuit.heads and faith.node_faithfulness == lf.node_faithfulness
    lc = qk.core_circuit(model, task, local, progress=False)
    assert (core.heads, core.mlps, core.curve) == (lc.heads, lc.mlps, lc.curve)
    assert set(core.heads) == {"0.0", "1.0"}                # the toy's induction circuit, known by construction


def test_the_circuit_command_runs_every_step_on_one_pool_of_the_recipe_backend(recipe, tmp_path, monkeypatch):
    """Every step of ``qkcircuits circuit`` is one ``pool.run``: with the recipe's backend as the command's, the
    JSON equals the local command's (timing aside), and the model was loaded once."""
    from qkcircuits.cli import circuit_command as cli_circuit
    from qkcircuits.cli import main

    a, b = tmp_path / "local.json", tmp_path / "recipe.json"
    common = ["circuit", "toy-induction", "--task", "induction", "--n", "6", "--method", "eap", "--edges", "4",
              "--quiet", "--device", "cpu"]
    assert main(common + ["--json", str(a)]) == 0
    backend = recipe["Recording"]()
    monkeypatch.setattr(cli_circuit, "backend", lambda args: backend)
    assert main(common + ["--json", str(b)]) == 0
    assert backend.opened == ["toy-induction"]
    # task, edge scores, core, curve (shards), sign check's EAP-IG, the --edges circuit's f, roles: all on the one pool
    # (the curve's plan and node view, then the same on the held-out prompts)
    assert backend.ran == ["task", "edge_scores", "core_circuit", "faithfulness", "node_view", "faithfulness",
                           "node_view", "edge_scores", "circuit_faithfulness", "roles"]
    assert [job for job, _ in backend.mapped] == ["edge_scores", "faithfulness", "faithfulness", "edge_scores"]
    la, lb = json.loads(a.read_text()), json.loads(b.read_text())
    for d in (la, lb):                      # how long each step took: the only numbers that may differ
        d.pop("timing"), d["core"].pop("seconds")
    assert lb == la
    assert la["core"]["heads"] == ["0.0", "1.0"] and la["circuit"]["n_edges"] <= 4 and "sign_check" in la


@pytest.mark.parametrize("graph", [{}, {"gqa": "ungrouped"}, {"positions": True}], ids=["grouped", "ungrouped",
                                                                                      "positions"])
def test_the_recipe_maps_shards_last_first_and_equals_local_exactly(recipe, toy_task, graph):
    """Every split analysis on the recipe's backend (its shards run in reverse order) equals the local one bit for
    bit: edge scores (EAP-IG and exact) and exact node scores on every graph option, the sweep, path patching, the
    faithfulness curve (m(clean) taken from the scores; and with its bootstrap and a held-out part)."""
    model, task = toy_task
    backend = recipe["Recording"]()
    tokens = qk.repeated_tokens(model, n_seqs=4, seg_len=5, seed=2)
    kw = dict(rows_per_shard=2, progress=False, **graph)
    held = qk.tasks.induction(model, n=4, seg_len=5, seed=3)
    sizes = (2, 10, 30, 100)
    with backend.pool(model) as p:
        got = {m: qk.edge_scores(model, task, method=m, backend=p, **kw) for m in ("eap-ig", "exact")}
        nodes = qk.node_scores(model, task, method="exact", backend=p, **kw)
        sweep = qk.sweep(model, tokens, "induction-loss", "resample", backend=p, progress=False)
        paths = qk.path_patch(model, "1.0,1.1", tokens=tokens, method="resample", shards=2, backend=p,
                              progress=False)
        faith = [qk.faithfulness(model, task, got["eap-ig"], sizes, rows_per_shard=2, progress=False, backend=p,
                                 **more) for more in ({}, {"bootstrap": 20, "holdout": held})]
    assert backend.mapped == [("edge_scores", 3), ("edge_scores", 3), ("node_scores", 3), ("sweep", 2),
                              ("path_patch", 2), ("faithfulness", 3), ("faithfulness", 3), ("faithfulness", 1)]
    # 6 prompts in 3 blocks; 2 layers; 2 row blocks; the curve's 3 blocks, the held-out 4 prompts in one
    for res, more in zip(faith, ({}, {"bootstrap": 20, "holdout": held}), strict=True):
        want = qk.faithfulness(model, task, got["eap-ig"], sizes, rows_per_shard=2, progress=False, **more)
        a, b = res.to_dict(), want.to_dict()
        a.pop("timing"), b.pop("timing")
        assert a == b and res.metric_values == want.metric_values
        assert res.curve[100.0] == 1.0 and res.clean > res.corrupt and bool(more) == bool(res.bootstrap)
    for m, res in got.items():
        want = qk.edge_scores(model, task, method=m, **kw)
        assert res.scores.nan_to_num().abs().max() > 1                          # the toy's edges carry the task
        _same(res.scores, want.scores)
        if graph.get("positions"):
            _same(res.position_scores, want.position_scores)
        assert (res.clean, res.corrupt, res.settings) == (want.clean, want.corrupt, want.settings)
    assert nodes.scores == qk.node_scores(model, task, method="exact", **kw).scores
    want = qk.sweep(model, tokens, "induction-loss", "resample", progress=False)
    _same(sweep.effects, want.effects)
    assert sweep.baseline == want.baseline and sweep.top(1)[0][0] == qk.Head(1, 0)
    want = qk.path_patch(model, "1.0,1.1", tokens=tokens, method="resample", shards=2, progress=False)
    for x in "qkv":
        _same(paths.effects[x], want.effects[x])
        _same(paths.clean[x], want.clean[x])
    assert paths.top(1, receiver="1.0", into="k")[0][0] == qk.Head(0, 0)                        # the toy's key path


def test_a_backend_with_only_run_still_works_everywhere(toy_task):
    # the recipe before pools: run(job, model, ...) alone; its pool hands each step to run
    model, task = toy_task
    seen = []

    class RunOnly(qk.Backend):
        name = "run-only"

        def run(self, job, model, *, local, **request):
            seen.append(job)
            return qk.Local().run(job, model, local=local, **request)

    z = qk.zoo(["toy-induction"], backend=RunOnly(), confirm_k=0, n_seqs=2, progress=False)
    assert z.models[0]["induction"][0]["head"] == "1.0" and z.settings["backend"] == "run-only"
    with RunOnly().pool(model) as p:
        s = qk.edge_scores(model, task, method="eap", backend=p, progress=False)
    assert seen == ["zoo_entry", "edge_scores"]
    _same(s.scores, qk.edge_scores(model, task, method="eap", progress=False).scores)

    class Nothing(qk.Backend):
        name = "nothing"

    with pytest.raises(NotImplementedError, match="writes neither pool"):
        Nothing().pool(model)


def test_the_local_pool_loads_once_and_releases_the_model(toy_task):
    model, task = toy_task
    p = qk.Local().pool("toy-induction")
    assert p.here is None
    with p:
        held = p.here
        assert held is not None and p.holds("toy-induction") and p.holds(held)
        with p:                                      # entered again (an analysis given backend=p): not reloaded
            assert p.here is held
        assert p.here is held                        # nor closed by the inner exit
    assert p.here is None and p.opened == 1
    with pytest.raises(QKCircuitsError, match="ray_address/workers given beside backend="):
        qk.as_backend(p, workers=2)
