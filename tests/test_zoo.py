"""qk.zoo / `qkcircuits zoo`: per-model induction and previous-token heads, depth, causal check, one page.

Ground truth: the hand-built model (0.0 previous-token, 1.0 induction, exact); a tiny random-weights
Llama-GQA folder (tests/_tiny.py) stands in for "a model without trained heads": its entry must be
complete and its scores the ones ``qk.scan`` gives it.
"""

from __future__ import annotations

import json
import pytest

import _tiny

import qkcircuits as qk
from qkcircuits._scale.zoo import ZOO_KEYS
from qkcircuits.cli import main



@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(_tiny.llama_dir(tmp_path_factory))


def _check_hand_built(m):
    assert set(ZOO_KEYS) <= set(m)
    assert (m["n_layers"], m["n_heads"]) == (2, 2)
    assert m["induction"] == [{"head": "1.0", "score": 1.0, "depth": 0.5}]
    assert m["previous_token"] == [{"head": "0.0", "score": 1.0, "depth": 0.0}]
    assert m["confirmation"]["heads"] == ["1.0"] and m["confirmation"]["effect"] > 3.0   # ln(V-1) on the toy
    assert m["k_sources"] == {"1.0": "0.0"}          # 1.0's keys read the previous-token head 0.0


def test_zoo_cli_json_and_offline_page(tmp_path, capsys, llama):
    j, page = tmp_path / "zoo.json", tmp_path / "zoo.html"
    assert main(["zoo", "toy-induction", llama, "--confirm", "1", "--n-seqs", "4", "--quiet",
                 "--json", str(j), "-o", str(page)]) == 0
    d = json.loads(j.read_text())
    assert [m["model"] for m in d["models"]] == ["toy-induction", llama]
    _check_hand_built(d["models"][0])
    other = d["models"][1]
    assert set(ZOO_KEYS) <= set(other) and (other["n_layers"], other["n_heads"]) == (2, 4)
    scores = qk.scan(qk.load(llama, device="cpu", verbose=False), n_seqs=4, copying=False, eigen_copying=False,
                     progress=False)
    want = [(str(h), round(v, 6)) for h, v in scores.top(8, "induction") if v >= 0.4]
    assert [(h["head"], h["score"]) for h in other["induction"]] == want
    best, v = scores.top(1, "previous_token")[0]
    assert other["strongest"]["previous_token"] == {"head": str(best), "score": round(v, 6), "depth": best.layer / 2}
    assert "95th percentile" in d["notes"]["k_sources"]
    assert set(other["k_sources"]) == {h["head"] for h in other["induction"]}
    for receiver, source in other["k_sources"].items():           # a K source is a head of an earlier layer
        assert source is None or qk.Head.parse(source).layer < qk.Head.parse(receiver).layer, (receiver, source)
    text = page.read_text()
    assert "Plotly.newPlot" in text and "toy-induction" in text and "<script src" not in text   # plotly inlined
    out = capsys.readouterr().out
    assert "toy-induction" in out and "1.0 1.00@0.50" in out and "toy-induction K sources: 1.0<-0.0" in out
    assert qk.Zoo.from_json(j).to_frame().query("kind == 'induction'").shape[0] == 1 + len(other["induction"])


def test_zoo_ray_equals_local(tmp_path, llama):
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        specs = ["toy-induction", llama]
        local = qk.zoo(specs, confirm_k=1, n_seqs=4, progress=False)
        remote = qk.zoo(specs, backend="ray", confirm_k=1, n_seqs=4, progress=False)
    finally:
        if started:
            ray.shutdown()
    for a, b in zip(local.models, remote.models):
        for k in ZOO_KEYS + ("scores",):
            assert a[k] == b[k], k
    assert remote.settings["backend"] == "ray" and "startup_s" in remote.timing


def test_zoo_errors(tmp_path):
    assert main(["zoo", "no/such/model.gguf", "--quiet"]) == 2
    with pytest.raises(qk.QKCircuitsError, match="list of one or more model specs"):
        qk.zoo("toy-induction")
