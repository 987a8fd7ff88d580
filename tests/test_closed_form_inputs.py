"""The closed-form q/k/v inputs and their VJP (``_foundation/inputs.py``) that the gradient and patched runs use in
place of one normed residual copy per receiver head, against independent computations:

- ``project`` against the block's own ``ln1`` module + W_x per head (``split_qkv_from_residuals``), with a
  DIFFERENT residual per head, so a formula that read the wrong copy would fail;
- ``input_vjp`` against autograd through that module path;
- edge scores with the closed form against edge scores with it switched off (the copies path), on tiny
  random GPT-2- (LayerNorm), Llama-GQA- and Llama-MQA- (RMSNorm, one KV head) and Gemma-3-shaped (RMSNorm with 1 + w, QK-norm,
  post-norms) models, each loaded folded and unfolded (fold_ln=False: the norm weights and GPT-2's LayerNorm
  bias are not trivial, so the fold into W̃ and b̃ is exercised);
- where it must not be used: a bf16 model, multi-head latent attention, a hook value it does not reproduce.
"""

import pytest
import torch

import qkcircuits as qk
from qkcircuits._foundation import inputs
from qkcircuits._tasks import graph as graph_mod, runs

from _tiny import deepseek_dir, gemma3_dir, gpt2_dir, llama_dir, llama_mqa_dir

FAMILIES = {"gpt2": gpt2_dir, "llama-gqa": llama_dir, "llama-mqa": llama_mqa_dir, "gemma3": gemma3_dir}


@pytest.fixture(scope="module", params=[(name, fold) for name in FAMILIES for fold in (True, False)],
                ids=lambda p: f"{p[0]}-{'folded' if p[1] else 'unfolded'}")
def family(request, tmp_path_factory):
    """Each family folded (the norms' weights are 1 and their biases 0 after fold_ln) and unfolded (the norm
    weight w, GPT-2's LayerNorm bias β and Gemma's 1 + w are then real numbers the closed form must fold)."""
    name, fold = request.param
    model = qk.load(str(FAMILIES[name](tmp_path_factory)), fold_ln=fold, verbose=False)
    if not fold:                       # the unfolded case carries information: the weights are not trivial
        from qkcircuits._foundation.arch.norms import block_norm

        norm = block_norm(model, 0)
        assert float((norm.weight - 1).abs().max()) > 0.05, name
        if name == "gpt2":
            assert float(norm.bias.abs().max()) > 0.05
    return name, model


def _recorded(model, n=3, p=7, seed=0):
    g = qk.graph(model)
    tokens = torch.randint(1, model.cfg.d_vocab, (n, p), generator=torch.Generator().manual_seed(seed))
    task = qk.Task(tokens, tokens.flip(1), tokens[:, 0], tokens[:, 1])
    return g, runs.record(model, g, task, tokens)


def _per_head_resid(x, n, seed=1):
    """n residuals near x, each head its own (the patched runs' case)."""
    g = torch.Generator().manual_seed(seed)
    return x.unsqueeze(0) + 0.3 * x.std() * torch.randn(n, *x.shape, generator=g, dtype=x.dtype)


def test_closed_form_projects_like_the_module_path(family):
    name, model = family
    g, rec = _recorded(model)
    for L in range(g.n_layers):
        x = rec.resid[("attn", L)]
        for into, n in (("q", g.n_heads), ("k", g.n_kv), ("v", g.n_kv)):
            parts = inputs.closed_form(model, L, into, x, rec.hooks[(into, L)])
            assert parts is not None, (name, L, into)
            assert parts.kind == ("LN" if name == "gpt2" else "RMS")
            resid = _per_head_resid(x, n)
            with torch.no_grad():
                want = graph_mod.split_qkv_from_residuals(model, L, into, resid, range(n))
            got = inputs.project(parts, resid, range(n))
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
            # a subset of heads, in another order: head j of the result is heads[j]'s input from resid[j]
            heads = list(range(n))[::-1][: max(1, n - 1)]
            with torch.no_grad():
                want_sub = graph_mod.split_qkv_from_residuals(model, L, into, resid[: len(heads)], heads)
            torch.testing.assert_close(inputs.project(parts, resid[: len(heads)], heads), want_sub,
                                       atol=2e-5, rtol=1e-4)


def test_input_vjp_equals_autograd_through_the_module(family):
    name, model = family
    g, rec = _recorded(model)
    gen = torch.Generator().manual_seed(3)
    for L in range(g.n_layers):
        x = rec.resid[("attn", L)]
        for into, n in (("q", g.n_heads), ("k", g.n_kv), ("v", g.n_kv)):
            parts = inputs.closed_form(model, L, into, x, rec.hooks[(into, L)])
            copies = x.detach().unsqueeze(0).expand(n, *x.shape).clone().requires_grad_(True)
            val = graph_mod.split_qkv_from_residuals(model, L, into, copies, range(n))
            c = torch.randn(val.shape, generator=gen, dtype=val.dtype)
            (want,) = torch.autograd.grad((val * c).sum(), copies)
            got = inputs.input_vjp(parts, x, c, range(n))
            scale = float(want.abs().max())
            assert scale > 0
            assert float((got - want).abs().max()) <= 1e-5 * scale + 1e-7, (name, L, into)
            dest = torch.full_like(want, float("nan"))                 # written in place, every element
            assert inputs.input_vjp(parts, x, c, range(n), out=dest) is dest
            torch.testing.assert_close(dest, got, atol=0, rtol=0)


def test_closed_form_refuses_what_it_does_not_reproduce(family):
    name, model = family
    g, rec = _recorded(model)
    x, hook = rec.resid[("attn", 0)], rec.hooks[("q", 0)]
    assert inputs.closed_form(model, 0, "q", x, hook * 1.01 + 0.1) is None     # not this model's value
    assert inputs.closed_form(model, 0, "q", x.to(torch.bfloat16), hook.to(torch.bfloat16)) is None


def test_closed_form_is_never_used_for_latent_attention(tmp_path_factory):
    model = qk.load(str(deepseek_dir(tmp_path_factory)), verbose=False)
    g, rec = _recorded(model)
    assert inputs.closed_form(model, 0, "q", rec.resid[("attn", 0)], rec.hooks[("q", 0)]) is None


def test_edge_scores_with_and_without_the_closed_form_agree(family, monkeypatch):
    """The closed form is an optimisation: the copies path (autograd through ln1 per head) is the reference."""
    name, model = family
    tokens = torch.randint(1, model.cfg.d_vocab, (6, 8), generator=torch.Generator().manual_seed(5))
    corrupt = tokens.clone()
    corrupt[:, 5] = (corrupt[:, 5] + 11) % model.cfg.d_vocab
    task = qk.Task(tokens, corrupt, tokens[:, 2], tokens[:, 3])
    used = []
    real = runs.closed_form

    def spy(*a, **k):
        parts = real(*a, **k)
        used.append(parts is not None)
        return parts

    monkeypatch.setattr(runs, "closed_form", spy)
    fast = qk.edge_scores(model, task, method="eap-ig", steps=2, progress=False).scores
    assert used and all(used)                 # the fast path really ran on every layer input
    monkeypatch.setattr(runs, "closed_form", lambda *a, **k: None)
    slow = qk.edge_scores(model, task, method="eap-ig", steps=2, progress=False).scores
    valid = qk.graph(model).valid                # the score matrix is NaN where (sender, receiver) is no edge
    fast, slow = fast[valid], slow[valid]
    assert torch.isfinite(fast).all() and torch.isfinite(slow).all()
    scale = float(slow.abs().max())
    assert scale > 0
    assert float((fast - slow).abs().max()) <= 1e-4 * scale


def test_a_gradient_hook_the_backward_never_reaches_is_an_error(family, monkeypatch):
    # a bridge whose attention keeps its own hook_v value (ignoring the one the hook returns) would leave every
    # edge into a v input with no gradient: scored 0 in silence. It must raise, naming the hook.
    name, model = family
    tokens = torch.randint(1, model.cfg.d_vocab, (3, 7), generator=torch.Generator().manual_seed(5))
    task = qk.Task(tokens, tokens.flip(1), tokens[:, 2], tokens[:, 3])
    real = runs._hooks

    def ignoring_v(*a, **k):
        out = []
        for hook_name, fn in real(*a, **k):
            if hook_name.endswith("attn.hook_v"):
                def fn(t, hook, inner=fn):
                    inner(t, hook)                  # the splice runs and registers its gradient hook...
                    return None                     # ...but the model reads its own value
            out.append((hook_name, fn))
        return out

    monkeypatch.setattr(runs, "_hooks", ignoring_v)
    with pytest.raises(qk.QKCircuitsError, match=r"never reached this model.s blocks\.0\.attn\.hook_v"):
        qk.edge_scores(model, task, method="eap", progress=False, check=False)
