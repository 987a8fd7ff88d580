"""Tasks (issue 17 ask 1): qk.Task checks, the IOI / induction / JSONL builders, metric sums over shards."""

import json
import warnings

import pytest
import torch

import qkcircuits as qk
from qkcircuits._tasks.task import evaluate

from _tiny import gpt2_dir

NAMES = ["Maria", "town", "old", "new", "them", "would", "asked", "their"]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return qk.load(str(gpt2_dir(tmp_path_factory)), verbose=False)


def test_task_checks_shapes_and_metric():
    with pytest.raises(qk.QKCircuitsError, match="same shape"):
        qk.Task(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long), 1, 2)
    with pytest.raises(qk.QKCircuitsError, match="unknown metric 'acc'; use one of logit-diff, prob-diff, answer-loss, kl"):
        qk.Task(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long), 1, 2, metric="acc")
    t = qk.Task(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long), 1, 2)
    assert t.answer.tolist() == [1, 1] and t.positions["END"].tolist() == [2, 2]


@pytest.mark.parametrize("metric", ["logit-diff", "prob-diff", "answer-loss"])
def test_metric_values_and_shard_sums(metric):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, 11, generator=g)
    task = qk.Task(torch.zeros(6, 4, dtype=torch.long), torch.zeros(6, 4, dtype=torch.long), torch.arange(6), torch.arange(6) + 3, metric=metric,
                   positions={"END": torch.tensor([3, 2, 1, 3, 3, 0])})
    rows = torch.arange(6)
    last = logits[rows, task.positions["END"]]
    p = last.softmax(-1)
    want = {"logit-diff": last[rows, task.answer] - last[rows, task.wrong],
            "prob-diff": p[rows, task.answer] - p[rows, task.wrong],
            "answer-loss": -p[rows, task.answer].log()}[metric]
    assert torch.allclose(task.row_values(logits), want, atol=1e-5)
    halves = sum(float(s.metric_sum(logits[i * 3:(i + 1) * 3])) for i, s in enumerate(task.shards(3)))
    assert halves == pytest.approx(float(task.metric_sum(logits)), abs=1e-5)


def test_induction_task_structure(hand_built):
    task = qk.tasks.induction(hand_built, n=6, seg_len=7, seed=3)
    L = 7
    assert task.bos and task.clean.shape == (6, 2 * L)
    R = task.clean[:, 1:L + 1]
    assert torch.equal(task.clean[:, L + 1:], R[:, :-1]) and torch.equal(task.answer, R[:, -1])
    Rc = task.corrupt[:, 1:L + 1]
    assert torch.equal(task.corrupt[:, L + 1:], R[:, :-1]) and torch.equal(task.wrong, Rc[:, -1])
    assert not any(bool(torch.isin(Rc[i], R[i]).any()) for i in range(6))        # R' disjoint from R
    out = evaluate(hand_built, task)
    assert out["clean"] > 10 and abs(out["corrupt"]) < 1e-3                      # the toy does induction


def test_ioi_builder_on_this_tokenizer(gpt2):
    task = qk.tasks.ioi(gpt2, n=6, seed=1, names=NAMES, places=["dra"], objects=["har"], frames=qk.tasks.FRAMES[:1])
    tok = gpt2.tokenizer
    assert task.clean.shape == task.corrupt.shape and task.bos is False
    for i in range(6):
        c = task.clean[i].tolist()
        io, s = task.answer[i].item(), task.wrong[i].item()
        assert c[task.positions["IO"][i]] == io and c[task.positions["S1"][i]] == s == c[task.positions["S2"][i]]
        assert task.positions["S1+1"][i] == task.positions["S1"][i] + 1
        text = tok.decode(c[:task.positions["END"][i] + 1])
        assert text == task.prompts[i] and text.endswith(" gave a har to")
        names_c = {t for t in task.corrupt[i].tolist() if tok.decode([t]).strip() in NAMES}
        assert io not in names_c and s not in names_c and len(names_c) == 3      # ABC: three fresh names
    # ABBA and BABA alternate: IO comes first in even rows, second in odd rows
    assert all((task.positions["IO"][i] < task.positions["S1"][i]) == (i % 2 == 0) for i in range(6))
    again = qk.tasks.ioi(gpt2, n=6, seed=1, names=NAMES, places=["dra"], objects=["har"], frames=qk.tasks.FRAMES[:1])
    assert torch.equal(task.clean, again.clean)
    with pytest.raises(qk.QKCircuitsError, match="single-token names"):
        qk.tasks.ioi(gpt2, n=4, names=["Mary", "Elizabeth"])


def _write(tmp_path, lines):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_from_jsonl_reads_and_pads(gpt2, tmp_path):
    rows = [{"clean": "the old town", "corrupt": "the new town", "answer": " would", "wrong": " asked"},
            {"clean": "them", "corrupt": "their", "answer": " old", "wrong": " new"}]
    task = qk.tasks.from_jsonl(gpt2, _write(tmp_path, [json.dumps(r) for r in rows] + [""]))
    lens = [len(gpt2.tokenizer(r["clean"], add_special_tokens=False)["input_ids"]) for r in rows]
    assert task.n == 2 and task.positions["END"].tolist() == [n - 1 for n in lens] and not task.bos
    assert lens[0] != lens[1] and task.clean.shape[1] == max(lens)              # right-padded
    assert task.answer[0].item() == gpt2.tokenizer(" would", add_special_tokens=False)["input_ids"][0]


@pytest.mark.parametrize("line,message", [
    ('{"clean": "the old", "corrupt": "the", "answer": " would", "wrong": " asked"}',
     r"line 1: clean has \d+ tokens and corrupt \d+"),
    ('{"clean": "old", "corrupt": "new", "answer": " would asked", "wrong": " asked"}', "line 1: answer ' would asked' is 2 tokens"),
    ('{"clean": "old", "corrupt": "new", "answer": " would", "wrong": " would"}', "line 1: answer and wrong are the same"),
    ('{"clean": "old", "corrupt": "new", "answer": " would", "wrong": " asked", "x": 1}', "line 1: unknown key"),
    ('{"clean": "old", "corrupt": "new", "answer": " would"}', "line 1: missing key"),
    ('{"clean": "old", ', "line 1: not valid JSON"),
    ('{"clean": "old", "corrupt": "new", "answer": " would", "wrong": " asked"} x',
     r"line 1: not valid JSON \(Extra data at column 75\)"),
    ('{"clean": "old", "corrupt": "new", "answer": " would", "wrong": " asked", "answer": " old"}',
     "line 1: key\\(s\\) 'answer' given more than once"),
    ('{"clean": "old", "corrupt": "new", "answer": "<|endoftext|>", "wrong": " asked"}',
     "line 1: answer '<\\|endoftext\\|>' is the tokenizer's special token 0"),
])
def test_from_jsonl_errors_are_one_line(gpt2, tmp_path, line, message):
    with pytest.raises(qk.QKCircuitsError, match=message) as e:
        qk.tasks.from_jsonl(gpt2, _write(tmp_path, [line]))
    assert "\n" not in str(e.value)


def test_from_jsonl_lines_end_at_newline_only(gpt2, tmp_path):
    # JSON strings may hold U+2028 / U+0085 raw (json.dumps(..., ensure_ascii=False) writes them so); CRLF files
    # and a UTF-8 byte-order mark are read; a byte that is not UTF-8 is named with its line
    rows = [{"clean": "the old\u2028town", "corrupt": "the new\u2028town", "answer": " would", "wrong": " asked"},
            {"clean": "them\u0085", "corrupt": "their\u0085", "answer": " old", "wrong": " new"}]
    p = tmp_path / "u.jsonl"
    p.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows).encode() + b"\r\n")
    task = qk.tasks.from_jsonl(gpt2, p)
    assert task.n == 2 and task.prompts == [r["clean"] for r in rows]
    lens = [len(gpt2.tokenizer(r["clean"], add_special_tokens=False)["input_ids"]) for r in rows]
    assert task.positions["END"].tolist() == [n - 1 for n in lens]
    p.write_bytes(json.dumps(rows[1]).encode() + b"\n" + b'{"clean": "a\xff"}\n')
    with pytest.raises(qk.QKCircuitsError, match=r"^u.jsonl line 2: not UTF-8 text \(invalid start byte at byte 13\)"):
        qk.tasks.from_jsonl(gpt2, p)


def test_from_jsonl_empty_and_missing(gpt2, tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text("\n\n")
    with pytest.raises(qk.QKCircuitsError, match="is empty"):
        qk.tasks.from_jsonl(gpt2, p)
    with pytest.raises(qk.QKCircuitsError, match="does not exist"):
        qk.tasks.from_jsonl(gpt2, tmp_path / "nope.jsonl")


def test_model_that_does_not_do_the_task_warns(hand_built):
    task = qk.tasks.induction(hand_built, n=4, seg_len=5)
    swapped = qk.Task(task.corrupt, task.clean, task.answer, task.wrong)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        evaluate(hand_built, swapped)
    assert any("does not do task" in str(x.message) for x in w)
    # the API a researcher calls says so too (a warning, not an error), once per call, and not for a task it does
    for call in (lambda t: qk.edge_scores(hand_built, t, method="eap", progress=False),
                 lambda t: qk.node_scores(hand_built, t, method="exact", progress=False)):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            call(swapped)
            call(task)
        assert sum("does not do task" in str(x.message) for x in w) == 1


def test_from_jsonl_named_positions(gpt2, tmp_path):
    # issue 37 ask 7: positions named by the word they hold in the clean prompt (first occurrence, or the n-th)
    tok = gpt2.tokenizer
    clean = "them old town and old them"
    ids = tok(clean, add_special_tokens=False)["input_ids"]
    old = tok(" old", add_special_tokens=False)["input_ids"]
    assert len(old) == 1 and ids.count(old[0]) == 2                # the fixture: " old" twice, one token
    at = [j for j, t in enumerate(ids) if t == old[0]]
    rows = [{"clean": clean, "corrupt": "them new town and new them", "answer": " would", "wrong": " asked",
             "positions": {"S": " old", "S2": {"text": " old", "occurrence": 2}, "T": " town"}},
            {"clean": "them town and old town", "corrupt": "them town and new town", "answer": " would",
             "wrong": " asked", "positions": {"S": " and", "S2": {"text": " town", "occurrence": 2}, "T": " old"}}]
    task = qk.tasks.from_jsonl(gpt2, _write(tmp_path, [json.dumps(r) for r in rows]))
    assert sorted(task.positions) == ["END", "S", "S2", "T"]
    assert task.positions["S"][0] == at[0] and task.positions["S2"][0] == at[1]
    # each named position holds the named word's token in the clean rows
    for i, r in enumerate(rows):
        for name, want in r["positions"].items():
            text = want if isinstance(want, str) else want["text"]
            assert task.clean[i, task.positions[name][i]] == tok(text, add_special_tokens=False)["input_ids"][0]
    # the same with a BOS prepended: every position moves one token to the right
    bos = qk.tasks.from_jsonl(gpt2, _write(tmp_path, [json.dumps(r) for r in rows]), prepend_bos=True)
    for k in task.positions:
        assert torch.equal(bos.positions[k], task.positions[k] + 1), k
    # named positions reach the roles' evidence (attention from END to each)
    scores = qk.edge_scores(gpt2, task, method="eap", progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = qk.roles(gpt2, task, scores.circuit(percent=50), force=True)
    assert all(set(x["evidence"]["attn_from_END"]) == {"END", "S", "S2", "T"} for x in r.roles.values())


@pytest.mark.parametrize("positions,message", [
    ({"S": " would"}, r"line 1: position 'S': ' would' \(token \d+\) does not occur in the clean prompt"),
    ({"S": " old town"}, r"line 1: position 'S': ' old town' is 2 tokens"),
    ({"S": {"text": " old", "occurrence": 3}}, r"line 1: position 'S': ' old' occurs 2 times in the clean prompt, "
                                               r"occurrence 3 asked"),
    ({"S": {"text": " old", "occurrence": 0}}, r"occurrence must be an integer >= 1, got 0"),
    ({"S": {"word": " old"}}, r"expected \{\"text\": word, \"occurrence\": n\}, got keys 'word'"),
    ({"END": " old"}, r"position 'END': END is where the metric reads"),
    ({}, r"positions must be a non-empty object"),
    ([" old"], r"positions must be a non-empty object .* got list"),
])
def test_from_jsonl_named_position_errors(gpt2, tmp_path, positions, message):
    line = {"clean": "them old town and old them", "corrupt": "them new town and new them", "answer": " would",
            "wrong": " asked", "positions": positions}
    with pytest.raises(qk.QKCircuitsError, match=message) as e:
        qk.tasks.from_jsonl(gpt2, _write(tmp_path, [json.dumps(line)]))
    assert "\n" not in str(e.value)


def test_from_jsonl_every_line_names_the_same_positions(gpt2, tmp_path):
    a = {"clean": "old town", "corrupt": "new town", "answer": " would", "wrong": " asked", "positions": {"S": " town"}}
    b = {k: v for k, v in a.items() if k != "positions"}
    with pytest.raises(qk.QKCircuitsError, match=r"line 2: names positions none, but line 1 named S; every line"):
        qk.tasks.from_jsonl(gpt2, _write(tmp_path, [json.dumps(a), json.dumps(b)]))
