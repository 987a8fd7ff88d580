"""Reliability probes of issue 43, rows 1, 2 and 9: heads, ranges and numbers are parsed against the model's shape
before anything is built (a range by its ends, digit counts bounded), in the library, the CLI, the API and the app;
the public API names what it takes. In-process on the hand-built 2x2 model (``toy-induction``)."""

from __future__ import annotations

import json
import re
import time
import tracemalloc

import pytest

import qkcircuits as qk
from qkcircuits import QKCircuitsError, parse_heads
from qkcircuits.viz import create_app

from _cli import errors, run
from _typecheck import unchecked

HUGE = "9" * 5000                      # past Python's 4,300-digit int() limit


@pytest.fixture(scope="module")
def app_client(hand_built):
    return create_app(hand_built, attend=[]).test_client()


def bounded(fn):
    """(result or exception, seconds, peak MB of Python allocations) of ``fn()``."""
    tracemalloc.start()
    t = time.perf_counter()
    try:
        out = fn()
    except Exception as e:                       # noqa: BLE001  (the exception is the result under test)
        out = e
    seconds = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1] / 2 ** 20
    tracemalloc.stop()
    return out, seconds, peak


@pytest.mark.parametrize("spec, fragment", [
    ("1.0-99999999", "8-digit number"),            # row 1: the range that hung the app (digits bounded)
    ("1.0-999999", "head 1.999999 is out of range"),   # six digits: checked by its end, not expanded
    ("1." + HUGE, "5000-digit number"),            # row 2: a 5,000-digit head
    (HUGE + ".0", "5000-digit number"),            # ... and layer
    ("L1H0-" + HUGE, "5000-digit number"),
])
def test_a_head_range_is_checked_by_its_ends_before_it_is_built(hand_built, spec, fragment):
    err, seconds, peak = bounded(lambda: qk.model_heads(hand_built, spec))
    assert isinstance(err, QKCircuitsError) and fragment in str(err), err
    assert "\n" not in str(err) and len(str(err)) < 200          # the bad value is named, cut short
    assert seconds < 0.5 and peak < 5, (seconds, peak)            # not 100 M heads built first


def test_without_the_shape_a_range_is_bounded_and_with_it_ranges_still_work(hand_built):
    assert parse_heads("0.0-4095") [-1] == qk.Head(0, 4095)
    with pytest.raises(QKCircuitsError, match="names 4097 heads; at most 4096"):
        parse_heads("0.0-4096")
    assert qk.model_heads(hand_built, "1.0-1, 0.*") == [qk.Head(1, 0), qk.Head(1, 1), qk.Head(0, 0), qk.Head(0, 1)]
    with pytest.raises(QKCircuitsError, match=r"head 2\.0 is out of range"):
        qk.model_heads(hand_built, "2.*")
    with pytest.raises(QKCircuitsError, match="cannot read a head"):
        parse_heads("1.*-3", n_heads=2)


@pytest.mark.parametrize("argv, fragment", [
    (["attend", "toy-induction", "--head", "1.0-3000000"], "7-digit number"),     # row 1 on the CLI (was 35 s)
    (["attend", "toy-induction", "--head", "1." + HUGE], "5000-digit number"),     # row 2 on the CLI (was exit 1)
    (["attend", "toy-induction", "--head", "1.0", "--seed", HUGE], "at most 18 digits"),
    (["attend", "toy-induction", "--head", "1.0", "--prompt", "a b", "--query", HUGE, "--key", "0"], "expected a position"),
    (["ablate", "toy-induction", "--heads", "0.0-5000"], "names 5001 heads"),
    (["ablate", "toy-induction", "--heads", "x.y"], "cannot read a head"),
    (["trace", "toy-induction", "--receivers", "1." + HUGE], "5000-digit number"),
    (["circuits", "toy-induction", "--head", HUGE + ".0"], "5000-digit number"),
    (["report", "toy-induction", "--heads", "1.0-99999999", "-o", "x.html"], "8-digit number"),
    (["scan", "toy-induction", "--n-seqs", HUGE], "at most 18 digits"),
    (["attend", "toy-induction", "--head", "1.0", "--scores", "missing.json"], "no scores JSON file at"),   # row 10
    (["attend", "toy-induction", "--head", "1.0", "--scores", "trace.json"], "qkcircuits.path_effects/1"),
])
def test_cli_bad_heads_and_giant_numbers_are_one_line_exit_2_before_the_model_loads(argv, fragment, capsys,
                                                                                     monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trace.json").write_text(json.dumps({"schema": "qkcircuits.path_effects/1"}))
    import qkcircuits._foundation.model as model_module

    monkeypatch.setattr(model_module, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    t = time.perf_counter()
    code, out, err = run(argv, capsys)
    assert code == 2 and len(errors(err)) == 1 and fragment in errors(err)[0], (code, err)
    assert "Traceback" not in err and len(errors(err)[0]) < 400 and time.perf_counter() - t < 2
    assert [p.name for p in tmp_path.iterdir()] == ["trace.json"]


@pytest.mark.parametrize("head, fragment", [
    ("1.0-99999999", "8-digit number"),
    ("1." + HUGE, "5000-digit number"),
    (HUGE + ".1", "5000-digit number"),
    ("1.0-999999", "out of range"),
])
def test_app_bad_heads_are_a_400_within_a_second(app_client, head, fragment):
    t = time.perf_counter()
    r = app_client.post("/api/head", data=json.dumps({"head": head}), content_type="application/json")
    assert r.status_code == 400 and fragment in r.get_json()["error"], r.get_json()
    assert time.perf_counter() - t < 1


# ------------------------------------------------------------------------------------------ row 3: safe CSV
HOSTILE = ['=HYPERLINK("http://x"),evil', "+1", "-2+3", "@SUM(A1)", "\tTAB", 'say "hi"']


def test_csv_fields_are_quoted_and_formulas_inert():
    import csv
    import io as _io

    from qkcircuits._foundation.io import csv_text

    text = csv_text(["name", "score"], [[h, -0.5] for h in HOSTILE] + [["plain", float("nan")]])
    rows = list(csv.reader(_io.StringIO(text)))
    assert all(len(r) == 2 for r in rows) and len(rows) == 1 + len(HOSTILE) + 1
    assert [r[0] for r in rows[1:-1]] == ["'" + h if h[0] in "=+-@\t" else h for h in HOSTILE]
    assert all(r[1] == "-0.5" for r in rows[1:-1]) and rows[-1] == ["plain", ""]   # numbers stay numbers


def test_circuit_csv_with_hostile_position_names_from_a_task_file(tmp_path_factory, tmp_path, capsys):
    """Row 3: named positions from a JSONL task file reach the edge names of a position graph; the --csv has 5
    fields on every line and no cell starting with a formula character."""
    import csv

    from _tiny import gpt2_dir

    names = {'=HYPERLINK("http://x"),evil': " old", "-cmd+1": " town"}
    lines = [{"clean": "the old town", "corrupt": "the new town", "answer": " would", "wrong": " asked",
              "positions": names},
             {"clean": "them old town", "corrupt": "them new town", "answer": " old", "wrong": " new",
              "positions": names}]
    task = tmp_path / "hostile.jsonl"
    task.write_text("\n".join(json.dumps(x) for x in lines))
    out = tmp_path / "c.csv"
    code, _, err = run(["circuit", gpt2_dir(tmp_path_factory), "--task", task, "--method", "eap", "--positions",
                        "--csv", out, "--quiet", "--device", "cpu", "--no-sign-check"], capsys)
    assert code == 0, err
    rows = list(csv.reader(out.open(newline="")))
    assert rows[0] == ["sender", "receiver", "input", "score", "in_circuit"] and len(rows) > 10
    assert all(len(r) == 5 for r in rows), [r for r in rows if len(r) != 5][:3]
    cells = [c for r in rows[1:] for c in r[:3]]
    assert not [c for c in cells if c[:1] in ("=", "+", "-", "@", "\t")]
    assert any(c.startswith("emb@") and c.endswith('@=HYPERLINK("http://x"),evil') for c in cells)   # one cell
    assert any(r[3].startswith("-") and float(r[3]) < 0 for r in rows[1:])     # negative scores stay numbers
    assert any("-cmd+1" in c for c in cells)


# ----------------------------------------------------------------- rows 5-7: one strict reader for every file
def _mib_text(g, edit):
    from test_mib import _random_scores

    d = json.loads(_random_scores(g).to_mib())
    return edit(d) if callable(edit) else edit


NAN_EDGE = "a0.h1->m0"


@pytest.mark.parametrize("text, fragment", [
    (lambda d: json.dumps(d).replace('"a0.h1->m0": {"score": ', '"a0.h1->m0": {"score": NaN, "x": ', 1),
     'edges["a0.h1->m0"].score is NaN'),
    (lambda d: json.dumps(d).replace('"a0.h1->m0": {"score": ', '"a0.h1->m0": {"score": Infinity, "x": ', 1),
     'edges["a0.h1->m0"].score is Infinity'),
    (lambda d: json.dumps(d).replace('"a0.h1->m0": {"score": ', '"a0.h1->m0": {"score": 1e400, "x": ', 1),
     'edges["a0.h1->m0"].score is 1e400, which is out of range for a float'),
    (lambda d: json.dumps(d).replace('"a0.h1->m0": {"score": ', '"a0.h1->m0": {"score": ' + "1" + "0" * 400 + ', "x": ', 1),
     "has 401 digits"),
    (lambda d: '{"cfg": ' + "[" * 200_000 + "]" * 200_000 + "}", "nested too deeply"),
    (lambda d: '{"cfg": ' + "[" * 100 + "]" * 100 + "}", "is nested more than 64 levels deep"),
    (lambda d: json.dumps({**d, "edges": {**d["edges"], NAN_EDGE: {"score": 1.0, "in_graph": "false"}}}),
     'edges["a0.h1->m0"].in_graph must be true or false, got "false"'),
    (lambda d: json.dumps({**d, "nodes": {**d["nodes"], "a7.h9": {"in_graph": True}}}),
     'nodes["a7.h9"] is not a node of this model\'s graph'),
    (lambda d: json.dumps({**d, "nodes": {**d["nodes"], "m0": {"in_graph": 1}}}), 'nodes.m0 must be'),
    (lambda d: json.dumps({**d, "edges": {**d["edges"], NAN_EDGE: {"score": 1.0, "weight": 2}}}),
     "unknown field 'weight'"),
    (lambda d: json.dumps({**d, "extra": 1}), "unknown key 'extra'"),
    (lambda d: json.dumps({**d, "cfg": {**d["cfg"], "parallel_attn_mlp": 1}}), "cfg parallel_attn_mlp is 1"),
    (lambda d: json.dumps(d).replace('"a0.h0->m0": {', '"a0.h0->m0": {"score": 1.0}, "a0.h0->m0": {', 1),
     "given more than once"),
])
def test_mib_import_refuses_what_it_must_in_one_line_naming_the_place(text, fragment, tmp_path):
    from qkcircuits._tasks.graph import Graph

    g = Graph(2, 4, 2, True, "m")
    path = tmp_path / "mib.json"
    path.write_text(_mib_text(g, text))
    err, seconds, _ = bounded(lambda: qk.results.EdgeScores.from_mib(path, g))
    assert isinstance(err, QKCircuitsError), repr(err)
    assert fragment in str(err) and str(err).startswith(str(path)) and "\n" not in str(err), str(err)
    assert seconds < 2


def test_mib_scores_that_sum_past_float32_are_refused(tmp_path):
    from qkcircuits._tasks.graph import Graph

    g = Graph(2, 4, 2, True, "m")        # grouped k/v: the two query heads of a group are summed
    d = json.loads(_mib_text(g, lambda d: json.dumps(d)))
    d["edges"]["input->a1.h2<v>"] = {"score": 3e38, "in_graph": False}
    d["edges"]["input->a1.h3<v>"] = {"score": 3e38, "in_graph": False}
    (tmp_path / "m.json").write_text(json.dumps(d))
    with pytest.raises(QKCircuitsError, match="past the float32 range"):
        qk.results.EdgeScores.from_mib(tmp_path / "m.json", g)


@pytest.mark.parametrize("line, fragment", [
    ('{"clean": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),          # row 6
    ('{"clean": "a", "corrupt": "b", "answer": " c", "wrong": " d", "positions": {"S": {"occurrence": NaN}}}',
     "positions.S.occurrence is NaN"),
    ('{"clean": "a", "corrupt": "b", "answer": " c", "wrong": " d", "positions": {"S": {"occurrence": '
     + "9" * 5000 + "}}}", "has 5000 digits"),
])
def test_jsonl_task_lines_go_through_the_strict_reader(line, fragment, tmp_path_factory, tmp_path, capsys):
    from _tiny import gpt2_dir

    task = tmp_path / "t.jsonl"
    task.write_text(line + "\n")
    code, _, err = run(["attend", gpt2_dir(tmp_path_factory), "--head", "1.0", "--task", task, "--to", "S",
                        "--no-labels", "--device", "cpu"], capsys)
    assert code == 2 and len(errors(err)) == 1 and "t.jsonl line 1: " in errors(err)[0], err
    assert fragment in errors(err)[0] and "Traceback" not in err


@pytest.mark.parametrize("content, fragment", [
    ('{"circuit": {"edges": ' + "[" * 100_000 + "]" * 100_000 + "}}", "nested too deeply"),   # row 6
    ('{"clean": NaN, "circuit": {"edges": []}}', "clean is NaN"),                              # row 7
    ('{"clean": 1e400, "circuit": {"edges": []}}', "clean is 1e400"),
    ('{"circuit": {"edges": [["0.0", "1.0", "k", -1e999]]}}', "circuit.edges[0][3] is -1e999"),
])
def test_report_circuit_files_go_through_the_strict_reader(content, fragment, tmp_path, capsys):
    (tmp_path / "c.json").write_text(content)
    code, _, err = run(["report", "toy-induction", "--circuit", tmp_path / "c.json", "-o", tmp_path / "r.html"], capsys)
    assert code == 2 and len(errors(err)) == 1 and fragment in errors(err)[0], err
    assert not (tmp_path / "r.html").exists()


# -------------------------------------------------------------- row 9: the public API says what it takes
@pytest.fixture(scope="module")
def toy_task(hand_built):
    task = qk.tasks.induction(hand_built, n=4, seg_len=3)
    return task, qk.edge_scores(hand_built, task, method="eap", progress=False)


@pytest.mark.parametrize("call, fragment", [
    (lambda m, t, s: unchecked(qk.attend)("toy-induction", "1.0", task=t), "call model = qk.load('toy-induction') first"),
    (lambda m, t, s: unchecked(qk.attend)(None, "1.0", task=t), "model must be a model from qk.load(...)"),
    (lambda m, t, s: unchecked(qk.attend)(m, "1.0", task="induction"), "task must be a qk.Task, got the string"),
    (lambda m, t, s: unchecked(qk.evaluate)(m, t, None), "circuit must be a circuit"),
    (lambda m, t, s: unchecked(qk.evaluate)(m, t, 5), "got int 5"),
    (lambda m, t, s: unchecked(qk.evaluate)(m, None, ["1.0"]), "task must be a qk.Task, got None"),
    (lambda m, t, s: unchecked(qk.faithfulness)(m, t, None), "scores must be edge scores"),
    (lambda m, t, s: unchecked(qk.faithfulness)("gpt2", t, s), "call model = qk.load('gpt2') first"),
    (lambda m, t, s: unchecked(qk.faithfulness)(m, "induction", s), "build it with qk.tasks.build_task(model, 'induction')"),
])
def test_api_misuse_is_one_sentence_naming_what_is_taken(hand_built, toy_task, call, fragment):
    with pytest.raises(QKCircuitsError) as e:
        call(hand_built, *toy_task)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)           # QKCircuitsError is the project's ValueError


def test_versus_equal_to_the_key_is_refused(tmp_path_factory, tmp_path, capsys):
    from _tiny import gpt2_dir

    task = tmp_path / "t.jsonl"
    task.write_text(json.dumps({"clean": "the old town", "corrupt": "the new town", "answer": " would",
                                "wrong": " asked", "positions": {"X": " old"}}) + "\n")
    for argv in (["--task", task, "--to", "X", "--versus", "X"],
                 ["--prompt", "a b a b", "--query", "3", "--key", "1", "--versus", "1"]):
        code, _, err = run(["attend", gpt2_dir(tmp_path_factory), "--head", "1.0", "--no-labels", "--device", "cpu",
                            *argv], capsys)
        assert code == 2 and len(errors(err)) == 1 and "is the key position itself" in errors(err)[0], err


# ---------------------------------------------------------------- row 10: the app against 127.0.0.1, bounded
@pytest.fixture(scope="module")
def served(hand_built):
    import threading

    from qkcircuits.viz._app import make_server

    server = make_server("127.0.0.1", 0, create_app(hand_built, attend=[]), read_timeout=1.0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.port
    server.shutdown()
    thread.join(5)


def raw_request(port, data: bytes, wait: float = 5.0):
    """(status code or None when the server closed without an answer, seconds) of one raw HTTP exchange; reads
    for at most ``wait`` seconds (a bounded loop: the test cannot hang)."""
    import socket

    t = time.perf_counter()
    out = b""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(data)
        try:
            while time.perf_counter() - t < wait:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
                if b"\r\n\r\n" in out and b"Connection: close" not in out.split(b"\r\n\r\n")[0]:
                    break
        except (socket.timeout, ConnectionResetError):
            pass
    status = int(out.split(b" ", 2)[1]) if out.startswith(b"HTTP/") else None
    return status, time.perf_counter() - t


HEAD = b"POST /api/head HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"


def test_app_slow_or_absent_body_is_let_go(served):
    status, seconds = raw_request(served, HEAD + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n")
    assert status in (408, None) and seconds < 3, (status, seconds)      # was: held until the client gave up
    status, seconds = raw_request(served, b"POST /api/head HTTP/1.1\r\nHost: 127.0.0.1\r\n")   # headers never end
    assert status in (408, None) and seconds < 3, (status, seconds)


def test_app_chunked_bodies_are_held_to_the_limit(served):
    from qkcircuits.viz._app import MAX_BODY

    def chunked(body: bytes) -> bytes:
        parts = b"".join(b"%x\r\n" % len(body[i:i + 4096]) + body[i:i + 4096] + b"\r\n"
                         for i in range(0, len(body), 4096))
        return HEAD + b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n" + parts + b"0\r\n\r\n"

    status, seconds = raw_request(served, chunked(json.dumps({"head": "1.0", "prompt": "x" * MAX_BODY}).encode()))
    assert status == 413 and seconds < 3, (status, seconds)               # was: cut at 64 KB, then a 400
    status, _ = raw_request(served, chunked(json.dumps({"head": "1.0", "prompt": "0 1 2"}).encode()))
    assert status == 200                                                    # a small chunked body is served


@pytest.mark.parametrize("ctype", [b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data"])
def test_app_serves_json_posts_only(served, ctype):
    body = b'{"head": "1.0"}'
    status, seconds = raw_request(served, HEAD + b"Content-Type: " + ctype + b"\r\nContent-Length: %d\r\n\r\n"
                                  % len(body) + body)
    assert status == 415 and seconds < 1


@pytest.mark.parametrize("scores, fragment", [("missing.json", "no scores JSON file at 'missing.json'"),
                                             ("attend.json", "expected 'qkcircuits.head_scores/1'")])
def test_attend_scores_of_the_wrong_kind_are_refused_before_the_model_loads(scores, fragment, tmp_path, capsys,
                                                                             monkeypatch):
    """Row 10: a missing or wrong-kind ``attend --scores`` was noticed only after the model load and the attribution."""
    import qkcircuits.cli.attend_command as attend_cli

    (tmp_path / "attend.json").write_text(json.dumps({"schema": "qkcircuits.attribution/1"}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(attend_cli, "load_model", lambda args: pytest.fail("the model was loaded"))
    code, _, err = run(["attend", "toy-induction", "--head", "1.0", "--scores", scores], capsys)
    assert code == 2 and len(errors(err)) == 1 and fragment in errors(err)[0], err


# -------------------------------------------------------- row 8: one run's outputs are committed as one set
SCAN = ["scan", "toy-induction", "--n-seqs", "2", "--seg-len", "6", "--scores", "induction", "--quiet"]


def _scan_argv(tmp_path):
    return SCAN + ["--json", tmp_path / "out.json", "--csv", tmp_path / "out.csv"]


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("failure, earlier", [("write", False), ("write", True), ("ctrl-c", True), ("sigterm", True)])
def test_a_failed_or_interrupted_run_writes_none_of_its_outputs(tmp_path, capsys, monkeypatch, failure, earlier):
    import tempfile

    from qkcircuits._foundation import io as qio

    if earlier:                                  # an earlier run's files stay exactly as they were
        (tmp_path / "out.json").write_text("earlier json")
        (tmp_path / "out.csv").write_text("earlier csv")
    before = _files(tmp_path)
    real = tempfile.mkstemp

    def failing_mkstemp(*a, prefix="", **k):     # the CSV is written after the JSON: it fails, or is interrupted
        if ".out.csv." in prefix:
            if failure == "write":
                raise OSError(28, "No space left on device")
            raise KeyboardInterrupt if failure == "ctrl-c" else qio.Terminated()
        return real(*a, prefix=prefix, **k)

    monkeypatch.setattr(qio.tempfile, "mkstemp", failing_mkstemp)
    code, _, err = run(_scan_argv(tmp_path), capsys)
    assert code == {"write": 2, "ctrl-c": 130, "sigterm": 143}[failure], err
    if failure == "write":
        assert "cannot write" in errors(err)[0] and "No space left on device" in errors(err)[0]
    assert _files(tmp_path) == before                  # no new file, no temporary file, nothing replaced


def test_a_run_replaces_its_earlier_outputs_together(tmp_path, capsys):
    (tmp_path / "out.json").write_text("earlier json")
    (tmp_path / "out.csv").write_text("earlier csv")
    code, _, err = run(_scan_argv(tmp_path), capsys)
    assert code == 0, err
    files = _files(tmp_path)
    assert sorted(files) == ["out.csv", "out.json"]
    assert json.loads(files["out.json"])["n_layers"] == 2 and files["out.csv"].startswith(b"layer,head,")


def test_a_rename_that_fails_puts_the_earlier_files_back(tmp_path, monkeypatch):
    import os

    from qkcircuits._foundation import io as qio

    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text("earlier " + name)
    real = os.replace
    calls = []

    def replace_once(src, dst):
        calls.append(dst)
        if str(dst).endswith("b.json") and not str(src).endswith(".old"):
            raise OSError(5, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(qio.os, "replace", replace_once)
    with pytest.raises(QKCircuitsError, match="no output of this run was written"):
        with qio.output_set([tmp_path / "a.json", tmp_path / "b.json"]):
            qio.write_atomic(tmp_path / "a.json", "new a")
            qio.write_atomic(tmp_path / "b.json", "new b")
    assert _files(tmp_path) == {"a.json": b"earlier a.json", "b.json": b"earlier b.json"}


def test_sigterm_outside_main_is_terminated_143():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import os, signal, time\nfrom qkcircuits import cli\n"
            "def fake(argv=None):\n    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(2)\n    return 0\n"
            "cli.main = fake\ncli.entry()\n")
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root,
                       env={**__import__("os").environ, "PYTHONPATH": str(root)})
    assert p.returncode == 143 and p.stderr.strip().splitlines() == ["terminated"], (p.returncode, p.stderr)


# ------------------------------------------- row 4: another model's result is refused unless asked for
def test_another_models_result_is_refused_unless_allow_other_model(tmp_path, capsys):
    out = tmp_path / "a.json"
    assert run(["attend", "toy-induction", "--head", "1.0", "--json", out, "--no-labels"], capsys)[0] == 0
    d = json.loads(out.read_text())
    assert d["model"] in ("toy-induction", "hand-built-induction")        # the result records its model
    other = tmp_path / "gpt2_attend.json"
    other.write_text(json.dumps({**d, "model": "gpt2"}))                  # the same head exists in both
    html = tmp_path / "r.html"
    code, _, err = run(["report", "toy-induction", "-o", html, "--quiet", "--grid-k", "1",
                        "--attend", other], capsys)
    assert code == 2 and len(errors(err)) == 1, err
    # both models named, each with its fingerprint (the file's was the toy's: only the name differs)
    assert re.search(r"is a result of model 'gpt2' \(fingerprint [0-9a-f]{12}\), not of 'toy-induction' \(fingerprint "
                     r"[0-9a-f]{12}\)", errors(err)[0]) and "--allow-other-model" in err, err
    assert not html.exists()
    # --allow-other-model lets it through (the check itself: a whole report is ~10 s on the toy)
    import argparse

    from qkcircuits._explain.attribution import Attribution
    from qkcircuits.cli.report_command import check_same_model

    res = Attribution.from_json(other)
    args = argparse.Namespace(model="toy-induction", allow_other_model=True)
    check_same_model(qk.load("toy-induction"), args, ("--attend", other, res))
    args.allow_other_model = False
    with pytest.raises(QKCircuitsError, match="is a result of model 'gpt2'"):
        check_same_model(qk.load("toy-induction"), args, ("--attend", other, res))
    check_same_model(qk.load("toy-induction"), args, ("--attend", out, Attribution.from_json(out)))
