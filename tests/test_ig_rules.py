"""EAP-IG's rules and the other gradient methods (issue 35 ask 6) against an independent implementation.

The reference here is a plain autograd loop over the interpolation points on transformers' own model in float64,
with module hooks and nothing from qkcircuits: each receiver input r (a query head's q, a KV head's k / v, an MLP's
input, the logits' input) reads its residual plus a zero tensor δ_r (its norm and projection re-applied to that
head's columns only), so ∂m/∂δ_r is the gradient EAP-IG averages; the score of s → r is Σ Δ_s · mean ∂m/∂δ_r with
Δ_s = out_s(clean) − out_s(corrupt) from two plain runs. Runs:

- EAP-IG (inputs): ``inputs_embeds`` = e_corrupt + α (e_clean − e_corrupt) at α = k/steps, k = 0..steps−1 ("left",
  the default and the authors' rule), k = 1..steps ("right") or (k + ½)/steps ("midpoint");
- EAP-IG on activations (the authors' ``get_scores_ig_activations``): clean inputs, one node at a time (the
  embedding, each layer's attention output, each MLP's output) replaced by the constant α·clean + (1 − α)·corrupt;
- clean-corrupted: the clean run and the corrupt run.
"""

import pytest
import torch

import _tiny
import qkcircuits as qk

from _tiny import gemma3_dir, gpt2_dir, llama_dir

FAMILIES = {"gpt2": gpt2_dir, "llama-gqa": llama_dir, "gemma3": gemma3_dir}


def contrast_task(model, n=6, p=8, seed=0):
    """As test_circuit_scores.contrast_task: answer/wrong = the tokens the corruption moves most (clean > corrupt)."""
    return _tiny.contrast_task(model, n, p, seed)


class Reference:
    """transformers' own model in float64 with hooks: sender outputs, and receiver gradients under any inputs_embeds
    and node replacements."""

    def __init__(self, folder):
        from _tiny import hf_model

        self.hf = hf = hf_model(folder).double()
        cfg = hf.config
        self.H = cfg.num_attention_heads
        self.dh = dh = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        self.kind = kind = cfg.model_type
        self.post = None
        if kind == "gpt2":                                       # fused c_attn, Conv1D (x @ W + b)
            self.layers, self.final, self.embed = hf.transformer.h, hf.transformer.ln_f, hf.transformer.wte
            self.ln1, self.ln2 = (lambda l: l.ln_1), (lambda l: l.ln_2)
            self.proj = {x: (lambda l: l.attn.c_attn) for x in "qkv"}
            self.col = lambda x, i: "qkv".index(x) * cfg.hidden_size + i * dh
            self.lin = lambda m, x: x @ m.weight + m.bias
            self.attn, self.o_proj, self.mlp_out = (lambda l: l.attn), (lambda l: l.attn.c_proj), (lambda l: l.mlp)
            self.head_w = lambda W, h: W[h * dh:(h + 1) * dh]
        else:
            self.layers, self.final, self.embed = hf.model.layers, hf.model.norm, hf.model.embed_tokens
            gem = kind.startswith("gemma")
            self.ln1 = lambda l: l.input_layernorm
            self.ln2 = (lambda l: l.pre_feedforward_layernorm) if gem else (lambda l: l.post_attention_layernorm)
            self.proj = {x: (lambda l, x=x: getattr(l.self_attn, f"{x}_proj")) for x in "qkv"}
            self.col = lambda x, i: i * dh
            self.lin = lambda m, x: torch.nn.functional.linear(x, m.weight, m.bias)
            self.attn, self.o_proj = (lambda l: l.self_attn), (lambda l: l.self_attn.o_proj)
            self.mlp_out = (lambda l: l.post_feedforward_layernorm) if gem else (lambda l: l.mlp)
            self.head_w = lambda W, h: W[:, h * dh:(h + 1) * dh].T
            self.post = (lambda l: l.post_attention_layernorm) if gem else None

    def run(self, emb, rows, answer, wrong, deltas=None, replace=None, record=False):
        """Metric mean (logit diff at the last position) of a run from ``emb`` (inputs_embeds); ``deltas``
        {receiver key: δ} added to those receivers' inputs; ``replace`` {("attn" | "mlp", L): constant output};
        ``record``: also the sender outputs."""
        deltas, replace = deltas or {}, replace or {}
        rec, handles = {}, []
        dh = self.dh

        def keep(key):     # the first call only: re-applying ln1 / ln2 to a receiver's own input calls it again
            def fn(m, a):
                rec.setdefault(key, a[0])
            return fn

        def proj_hook(L, x):
            def fn(m, a, o):
                mine = [(k, d) for k, d in deltas.items() if k[0] == x and k[1] == L]
                if not mine:
                    return None
                o = o.clone()
                for (_, _, i), d in mine:
                    cols = slice(self.col(x, i), self.col(x, i) + dh)
                    o[..., cols] = self.lin(m, self.ln1(self.layers[L])(rec[("pre", L)] + d))[..., cols]
                return o
            return fn

        def mlp_in(L):
            return lambda m, a: (self.ln2(self.layers[L])(rec[("mid", L)] + deltas[("mlp", L)]),) \
                if ("mlp", L) in deltas else None

        def replaced(key, tuple_out):
            def fn(m, a, o):
                if key not in replace:
                    return None
                return (replace[key],) + tuple(o[1:]) if tuple_out else replace[key]
            return fn

        def zy(L):
            return lambda m, a, o: rec.__setitem__(("zy", L), (a[0], o))

        def mlp_o(L):
            return lambda m, a, o: rec.__setitem__(("mlp_o", L), o)

        for L, lay in enumerate(self.layers):
            handles += [self.ln1(lay).register_forward_pre_hook(keep(("pre", L))),
                        self.ln2(lay).register_forward_pre_hook(keep(("mid", L))),
                        lay.mlp.register_forward_pre_hook(mlp_in(L)),
                        self.attn(lay).register_forward_hook(replaced(("attn", L), True)),
                        self.mlp_out(lay).register_forward_hook(replaced(("mlp", L), False)),
                        self.o_proj(lay).register_forward_hook(zy(L)),
                        self.mlp_out(lay).register_forward_hook(mlp_o(L))]
            if self.kind == "gpt2":           # one fused projection: one hook serves q, k and v
                handles.append(self.proj["q"](lay).register_forward_hook(
                    lambda m, a, o, L=L: self._fused(m, o, L, rec, deltas)))
            else:
                handles += [self.proj[x](lay).register_forward_hook(proj_hook(L, x)) for x in "qkv"]
        handles.append(self.final.register_forward_pre_hook(
            lambda m, a: (a[0] + deltas["logits"],) if "logits" in deltas else None))
        try:
            lg = self.hf(inputs_embeds=emb).logits[rows, -1]
            m = (lg[rows, answer] - lg[rows, wrong]).mean()
        finally:
            for h in handles:
                h.remove()
        if not record:
            return m
        out = {"emb": rec[("pre", 0)]}
        for L, lay in enumerate(self.layers):
            z, y = rec[("zy", L)]
            for h in range(self.H):
                o = z[..., h * dh:(h + 1) * dh] @ self.head_w(self.o_proj(lay).weight, h)
                if self.post is not None:
                    pn = self.post(lay)
                    o = o * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + pn.eps) * (1 + pn.weight)
                out[f"{L}.{h}"] = o
            out[f"mlp{L}"] = rec[("mlp_o", L)]
        return m, out, rec

    def _fused(self, m, o, L, rec, deltas):
        mine = [(k, d) for k, d in deltas.items() if k[0] in "qkv" and k[1] == L]
        if not mine:
            return None
        o = o.clone()
        for (x, _, i), d in mine:
            cols = slice(self.col(x, i), self.col(x, i) + self.dh)
            o[..., cols] = self.lin(m, self.ln1(self.layers[L])(rec[("pre", L)] + d))[..., cols]
        return o


def reference_scores(ref: Reference, task, edges, method: str, steps: int, rule: str):
    """{(sender, (receiver, input)): score} by the plain autograd loop (module docstring)."""
    rows = torch.arange(task.n)
    with torch.no_grad():
        e_clean, e_corr = ref.embed(task.clean).double(), ref.embed(task.corrupt).double()
        _, clean, clean_rec = ref.run(e_clean, rows, task.answer, task.wrong, record=True)
        _, corr, corr_rec = ref.run(e_corr, rows, task.answer, task.wrong, record=True)
    recv = sorted({r for _, r in edges})

    def key(r):
        name, x = r
        if name == "logits":
            return "logits"
        if x == "in":
            return ("mlp", int(name[3:]))
        L, i = name.split(".")
        return (x, int(L), int(i.replace("kv", "")))

    shift = {"left": 0.0, "right": 1.0, "midpoint": 0.5}[rule]
    alphas = {"eap-ig": [(k + shift) / steps for k in range(steps)], "clean-corrupted": [1.0, 0.0],
              "eap-ig-activations": [(k + shift) / steps for k in range(steps)]}[method]
    plans = []                                  # (inputs_embeds, replacements) per gradient run
    if method == "eap-ig-activations":
        L = len(ref.layers)
        for node in [("emb", 0)] + [(kind, l) for l in range(L) for kind in ("attn", "mlp")]:
            for a in alphas:
                if node[0] == "emb":
                    plans.append((e_corr + a * (e_clean - e_corr), {}))
                else:
                    c = clean_rec[("zy", node[1])][1] if node[0] == "attn" else clean_rec[("mlp_o", node[1])]
                    x = corr_rec[("zy", node[1])][1] if node[0] == "attn" else corr_rec[("mlp_o", node[1])]
                    plans.append((e_clean, {node: (x + a * (c - x)).detach()}))
    else:
        plans = [(e_corr + a * (e_clean - e_corr), {}) for a in alphas]
    grads = {r: torch.zeros_like(e_clean) for r in recv}
    for emb, replace in plans:
        deltas = {key(r): torch.zeros_like(e_clean, requires_grad=True) for r in recv}
        m = ref.run(emb, rows, task.answer, task.wrong, deltas=deltas, replace=replace)
        got = torch.autograd.grad(m, [deltas[key(r)] for r in recv], allow_unused=True)
        for r, gr in zip(recv, got):
            if gr is not None:
                grads[r] += gr / len(plans)
    return {(s, r): float(((clean[s] - corr[s]) * grads[r]).sum()) for s, r in edges}


_LOADED = {}


def loaded(name, tmp_path_factory):
    """(transformers' reference, the bridge) of a family, once per session."""
    if name not in _LOADED:
        folder = FAMILIES[name](tmp_path_factory)
        _LOADED[name] = (Reference(folder), qk.load(str(folder), verbose=False))
    return _LOADED[name]


def _edges(g, model):
    last = model.cfg.n_layers - 1
    recv = [("0.2", "q"), (g.kv_name(0, 1), "k"), (g.kv_name(0, 0), "v"), (f"{last}.1", "q"),
            (g.kv_name(last, 1), "k"), (g.kv_name(last, 0), "v"), (f"mlp{last}", "in"), ("logits", "in"),
            ("mlp0", "in")]
    return [(s, r) for r in recv for s in ("emb", "0.3", "mlp0", f"{last - 1}.0", f"{last - 1}.2")
            if g.valid[g.senders.index(s), g.receivers.index(r)]]


# every rule and method on at least one family; the default (left) on all three; activations where the node outputs
# differ most from the heads' (GQA; Gemma's attention output before its post-norm, its MLP output after it)
CASES = [("gpt2", "eap-ig", "left"), ("gpt2", "eap-ig", "right"), ("gpt2", "clean-corrupted", "left"),
         ("llama-gqa", "eap-ig", "left"), ("llama-gqa", "eap-ig", "midpoint"), ("llama-gqa", "eap-ig-activations", "right"),
         ("gemma3", "eap-ig", "left"), ("gemma3", "eap-ig", "right"), ("gemma3", "eap-ig-activations", "left")]


@pytest.mark.parametrize("name,method,rule", CASES)
def test_gradient_methods_equal_a_plain_autograd_loop(tmp_path_factory, name, method, rule):
    ref, model = loaded(name, tmp_path_factory)
    g = qk.graph(model)
    task = contrast_task(model)
    edges = _edges(g, model)
    assert len(edges) >= 25
    steps = 2
    want = reference_scores(ref, task, edges, method, steps, rule)
    got = qk.edge_scores(model, task, method=method, steps=steps,
                         rule=None if method == "clean-corrupted" else rule, progress=False)
    assert got.rule == (None if method == "clean-corrupted" else rule)
    worst = max(abs(float(got.scores[g.senders.index(s), g.receivers.index(r)]) - v) for (s, r), v in want.items())
    scale = max(abs(v) for v in want.values())
    assert scale > 1e-2 and worst <= 1e-5, (name, method, rule, worst, scale)


def test_rules_differ_and_right_with_one_step_is_eap(tmp_path_factory):
    # the three rules are different estimates (not one rule under three names); with one step the right rule's
    # point is the clean run (EAP), the left rule's the corrupt run (= the corrupt half of clean-corrupted)
    _, model = loaded("llama-gqa", tmp_path_factory)
    task = contrast_task(model)
    s = {r: qk.edge_scores(model, task, method="eap-ig", steps=2, rule=r, progress=False).scores
         for r in ("left", "right", "midpoint")}
    valid = qk.graph(model).valid
    assert all(float((s[a] - s[b])[valid].abs().max()) > 1e-4 for a, b in (("left", "right"), ("left", "midpoint")))
    eap = qk.edge_scores(model, task, method="eap", progress=False).scores
    one_right = qk.edge_scores(model, task, method="eap-ig", steps=1, rule="right", progress=False).scores
    one_left = qk.edge_scores(model, task, method="eap-ig", steps=1, rule="left", progress=False).scores
    cc = qk.edge_scores(model, task, method="clean-corrupted", progress=False).scores
    torch.testing.assert_close(one_right[valid], eap[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(cc[valid], (eap[valid] + one_left[valid]) / 2, atol=1e-5, rtol=0)


def test_rule_is_recorded_and_checked(hand_built):
    task = qk.tasks.induction(hand_built, n=4, seg_len=5)
    s = qk.edge_scores(hand_built, task, method="eap-ig", steps=2, progress=False)
    assert s.rule == "left" and s.settings["alphas"] == [0.0, 0.5] and s.settings["gradient_runs"] == 2
    back = type(s).from_json(s.to_json())
    assert back.rule == "left"
    del back.settings["rule"]                    # a file written before the rule was recorded: the right rule then
    assert back.rule == "right"
    assert qk.edge_scores(hand_built, task, method="eap", progress=False).rule is None
    with pytest.raises(qk.QKCircuitsError, match="unknown rule 'trapezoid'"):
        qk.edge_scores(hand_built, task, method="eap-ig", rule="trapezoid", progress=False)
    with pytest.raises(qk.QKCircuitsError, match="rule='left' applies to eap-ig and eap-ig-activations only"):
        qk.edge_scores(hand_built, task, method="eap", rule="left", progress=False)
