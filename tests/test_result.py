"""The Result base: one JSON contract (schema checked, files named in errors, atomic writes) for every result."""

from __future__ import annotations

import json

import pytest
import torch

import qkcircuits as qk


def _results(hand_built):
    m = hand_built
    toks = qk.repeated_tokens(m, n_seqs=2, seg_len=5, seed=0)
    scores = qk.scan(m, scores="induction,previous_token", progress=False)
    return [scores, qk.sweep(m, toks, progress=False), qk.group_effect(m, ["1.0"], toks),
            qk.compare_to_random(m, ["1.0"], toks, n_draws=3), qk.composition_scores(m, "K"),
            qk.circuit(m, "1.0", "ov"), qk.capture(m, toks, ["pattern"], layers=[0]),
            qk.path_patch(m, "1.0", progress=False)]


def test_every_result_round_trips_with_its_schema_and_versions(hand_built, tmp_path):
    for r in _results(hand_built):
        cls = type(r)
        assert isinstance(r, qk.Result) and cls.SCHEMA.startswith("qkcircuits.") and cls.SCHEMA.endswith("/1")
        path = tmp_path / f"{cls.__name__}.json"
        text = r.to_json(path)
        assert path.read_text() == text and json.loads(text)["schema"] == cls.SCHEMA
        assert json.loads(text)["settings"]["versions"]["qkcircuits"] == qk.__version__
        back = cls.from_json(path)
        assert back.to_json() == text, cls.__name__          # exact numbers: the same file again
        assert cls.from_json(back.to_json()).to_json() == back.to_json()      # stable after one round trip
        assert type(qk.load_result(text)) is cls
        assert repr(back) == repr(r) and back._repr_html_().startswith("<style>")
        assert repr(r).startswith(cls.__name__ + "(")
        r.to_frame()                                         # every result has a table form
        assert len(r.top(1)) <= 1


def test_from_json_errors_say_what_was_expected(hand_built, tmp_path):
    s = qk.scan(hand_built, scores="induction", progress=False)
    wrong = tmp_path / "sweep.json"
    qk.sweep(hand_built, qk.repeated_tokens(hand_built, n_seqs=2, seg_len=5, seed=0), progress=False).to_json(wrong)
    with pytest.raises(qk.QKCircuitsError, match=r"sweep.json'?: it has schema 'qkcircuits.head_effects/1', not a "
                                                 r"scan's --json output .* \(that is a HeadEffects: use "
                                                 r"HeadEffects.from_json\); expected 'qkcircuits.head_scores/1'"):
        qk.results.HeadScores.from_json(wrong)
    newer = json.loads(s.to_json())
    newer["schema"] = "qkcircuits.head_scores/9"
    with pytest.raises(qk.QKCircuitsError, match="reads qkcircuits.head_scores versions 1 to 1"):
        qk.results.HeadScores.from_json(json.dumps(newer))
    broken = tmp_path / "broken.json"
    broken.write_text('{"schema": "qkcircuits.head_scores/1", "model": "x"}')
    with pytest.raises(qk.QKCircuitsError, match=r"broken.json: not a scan's --json output .*expected the keys model"):
        qk.results.HeadScores.from_json(broken)
    with pytest.raises(qk.QKCircuitsError, match=r"no JSON file at '.*missing.json'"):
        qk.results.HeadScores.from_json(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(qk.QKCircuitsError, match=r"bad.json'? is not valid JSON"):
        qk.results.HeadScores.from_json(tmp_path / "bad.json")


def test_files_without_schema_still_read(hand_built):
    """Files written before schemas (HeadEffects, CompositionScores had none) are read as version 1."""
    toks = qk.repeated_tokens(hand_built, n_seqs=2, seg_len=5, seed=0)
    e = qk.sweep(hand_built, toks, progress=False)
    d = json.loads(e.to_json())
    del d["schema"], d["settings"]
    back = qk.results.HeadEffects.from_json(json.dumps(d))
    torch.testing.assert_close(back.effects, e.effects, equal_nan=True)
    assert back.settings == {}                               # no versions invented for an old file


def test_public_arguments_use_the_one_vocabulary(hand_built):
    comp = qk.composition_scores(hand_built, "K")
    best = comp.partners(qk.Head(1, 0), k=1)
    assert best[0][0] == qk.Head(0, 0)                                  # 1.0 reads 0.0's OV
    assert qk.k_composition_partners(hand_built, ["1.0"], k=1)[qk.Head(1, 0)][0][0] == qk.Head(0, 0)
    rows = qk.weights.token_inputs(hand_built, 0, [1, 2], view="direct").rows
    torch.testing.assert_close(rows, hand_built.W_E[[1, 2]])             # direct at layer 0: the embedding rows
    assert qk.INTO == ("q", "k", "v") and qk.VIEWS == ("direct", "effective", "contextual")


def test_task_circuit_verify_and_kv_results_round_trip(hand_built, tmp_path):
    """EdgeScores, NodeScores, TaskCircuit, Faithfulness, Roles, CircuitCheck and KVCache are Results: a file
    of each reads back (by its class and by qk.load_result) to the same JSON, and keeps its old keys."""
    m = hand_built
    task = qk.tasks.induction(m, n=4, seg_len=5)
    scores = qk.edge_scores(m, task, method="eap", progress=False)
    faith = qk.faithfulness(m, task, scores, sizes=(50, 100), progress=False)
    circ = scores.circuit(edges=4)
    roles = qk.roles(m, task, circ)
    results = [scores, qk.node_scores(m, task, method="eap", progress=False), circ, faith, roles,
               qk.verify_circuits(m), qk.kv_cache(m)]
    for r in results:
        cls = type(r)
        assert isinstance(r, qk.Result) and cls.SCHEMA.startswith("qkcircuits.") and cls.SCHEMA.endswith("/1")
        path = tmp_path / f"{cls.__name__}.json"
        text = r.to_json(path)
        d = json.loads(text)
        assert path.read_text() == text and d["schema"] == cls.SCHEMA, cls.__name__
        back = cls.from_json(path)
        assert back.to_json() == text, cls.__name__                 # nothing lost, nothing invented
        assert type(qk.load_result(path)) is cls and repr(back) == repr(cls.from_json(back.to_json()))
        assert len(r.to_frame()) > 0 and len(r.top(1)) == 1
    # the known circuit of the toy (0.0 -> k of 1.0 -> logits) survives the file, and the circuit view reads it
    back = qk.results.TaskCircuit.from_json(tmp_path / "TaskCircuit.json")
    def same_edges(a, b):      # the file keeps 6 decimals
        return [e[:3] for e in a] == [e[:3] for e in b] and all(abs(x[3] - y[3]) < 1e-6 for x, y in zip(a, b))

    assert same_edges(back.edges(), circ.edges()) and back.heads == circ.heads == ["0.0", "1.0"]
    from qkcircuits.viz._circuit_data import load_circuit

    assert load_circuit(tmp_path / "TaskCircuit.json").heads == ["0.0", "1.0"]
    f = qk.results.Faithfulness.from_json(tmp_path / "Faithfulness.json")
    assert f.curve[100.0] == 1.0 and same_edges(f.circuit.edges(), faith.circuit.edges()) and f.node_heads == faith.node_heads
    # old keys kept: the circuit part of `qkcircuits circuit --json`, the roles map, the check's numbers
    assert {"edges", "heads", "mlps", "n_edges", "requested_edges", "percent", "by"} <= set(circ.to_dict())
    assert json.loads(roles.to_json())["roles"] == roles.roles and all("role" in v for v in roles.roles.values())
    check = json.loads((tmp_path / "CircuitCheck.json").read_text())
    assert check["passed"] is True and len(check["qk_error"]) == 2
    assert qk.verify_circuits(m).top(1)[0][1] == qk.verify_circuits(m).max_error
    with pytest.raises(qk.QKCircuitsError, match=r"it has schema 'qkcircuits.edge_scores/1', not a faithfulness "
                                                 r"JSON .*\(that is a EdgeScores: use EdgeScores.from_json\)"):
        qk.results.Faithfulness.from_json(tmp_path / "EdgeScores.json")
    tiny = qk.results.CircuitCheck.from_json(tmp_path / "CircuitCheck.json")  # errors ~1e-7 keep every digit
    torch.testing.assert_close(tiny.qk_error, results[5].qk_error, rtol=0, atol=0)


def test_a_head_circuit_and_a_task_circuit_file_have_different_schemas(hand_built, tmp_path):
    """`qk.circuit(...)` (one head's QK/OV) and `qkcircuits circuit --json` (a task's circuit) once shared the
    schema "qkcircuits.circuit/1": load_result then read a CLI file as a head circuit and failed on missing keys."""
    import json as _json

    import qkcircuits as qk
    from qkcircuits.cli.circuit_command import SCHEMA as CLI_SCHEMA

    head = qk.circuit(hand_built, "1.0", "qk")
    assert _json.loads(head.to_json())["schema"] != CLI_SCHEMA
    assert type(qk.load_result(head.to_json())).__name__ == "Circuit"
    # the command's file is a CircuitReport (qk.find_circuit's result); one missing a key it needs is one line
    with pytest.raises(qk.QKCircuitsError) as e:
        qk.load_result(_json.dumps({"schema": CLI_SCHEMA, "curve": {}}))
    assert "'circuit'" in str(e.value) and "qkcircuits circuit --json" in str(e.value) and "\n" not in str(e.value)
    report = qk.load_result(_json.dumps({"schema": CLI_SCHEMA, "curve": {"100": 1.0}, "circuit": {"edges": []}}))
    assert type(report).__name__ == "CircuitReport" and report.curve == {100.0: 1.0}
