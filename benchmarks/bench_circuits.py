"""Full-vocabulary circuit statistics on SmolLM2-135M (49,152 tokens): time and peak memory, ours vs the TL way.

    python benchmarks/bench_circuits.py [--model smollm2-135m] [--acc-heads 2] [--tl-layers 1] [--tl-comp-layers 6]

One process, one CPU thread. Peak memory is the process RSS above its level before each call,
sampled every 2 ms (torch's CPU allocations are invisible to tracemalloc).

- Eigen copying score of the full OV circuit W_E·OV·W_U for all heads. Ours: G = W_U·W_E [d_model²]
  once, then O·G·V [d_head²] per head. TL way (ARENA): FactoredMatrix(W_E W_V, W_O W_U).eigenvalues,
  i.e. two [vocab, d_head] factors and a vocab-long BA product per head; timed on ``--tl-layers``
  layers and scaled to all heads. Their scores must agree.
- Full-OV top-1 copying accuracy (ARENA) over the whole vocabulary for the ``--acc-heads`` strongest
  eigen copiers at two memory bounds (128 MiB and 32 MiB of rows at a time); the dense alternative
  would hold vocab² floats (9.0 GiB) per head.
- K-composition [L, H, L, H] with baseline, and on the first ``--tl-comp-layers`` layers side by side
  with TL's composition_scores (TL's all_composition_scores on all 30 layers would broadcast ~10.7 GB).
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import torch

import qkcircuits as qk


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trim() -> None:
    """Hand freed heap pages back to the OS (glibc), so the next call's allocations show in RSS."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def timed(fn):
    """(result, seconds, peak RSS above the starting RSS in bytes)."""
    import gc
    gc.collect()
    _trim()
    start, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss() - start)
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    done.set()
    th.join()
    return out, dt, max(peak[0], _rss() - start)


def mib(b: int) -> str:
    return f"{b / 2 ** 20:8.1f} MiB"


def tl_copying(model, layers):
    """ARENA/TL: FactoredMatrix(E W_V, W_O U).eigenvalues per layer (same normalised E and U as ours)."""
    from transformer_lens.FactoredMatrix import FactoredMatrix

    E, U = qk.weights.embed_rows(model, 0), qk.weights.unembed_cols(model)
    out = []
    with torch.no_grad():
        for layer in layers:
            w = qk.weights.layer_weights(model, layer)
            lam = FactoredMatrix(E @ w.W_V, w.W_O @ U).eigenvalues
            out.append(qk.weights.eigen_copying(lam))
    return torch.stack(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--acc-heads", type=int, default=2)
    ap.add_argument("--tl-layers", type=int, default=1)
    ap.add_argument("--tl-comp-layers", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = qk.load(args.model, device="cpu", verbose=False)
    L, H, V = model.cfg.n_layers, model.cfg.n_heads, model.cfg.d_vocab
    print(f"{args.model}: {L} layers x {H} heads, d_model {model.cfg.d_model}, d_head {model.cfg.d_head}, vocab {V}; "
          f"1 thread, CPU only")

    ours, t_ours, m_ours = timed(lambda: qk.copying_scores(model))
    layers = list(range(args.tl_layers))
    tl, t_tl, m_tl = timed(lambda: tl_copying(model, layers))
    diff = float((tl - ours[layers]).abs().max())
    t_tl_all = t_tl * L / len(layers)
    print(f"full-OV eigen copying, all {L * H} heads: ours {t_ours:7.2f} s, peak {mib(m_ours)} | TL way "
          f"{t_tl:.2f} s for {len(layers) * H} heads -> ~{t_tl_all:.0f} s for all (x{t_tl_all / t_ours:.1f}), peak "
          f"{mib(m_tl)} | max |diff| {diff:.1e}")
    _, t_ov, m_ov = timed(lambda: qk.copying_scores(model, full=False))
    print(f"OV-only eigen copying, all heads: {t_ov:.2f} s, peak {mib(m_ov)}")

    best = ours.flatten().argsort(descending=True)[:args.acc_heads].tolist()     # the strongest copiers
    heads = [qk.Head(i // H, i % H) for i in best]
    for bound in (128 * 2 ** 20, 32 * 2 ** 20):
        accs, t, m = timed(lambda: [float(qk.weights.copying_accuracy(model, h, max_bytes=bound)) for h in heads])
        print(f"full-OV top-1 copying accuracy, bound {bound // 2 ** 20} MiB ({bound // (model.W_E.element_size() * V)} rows/chunk): "
              f"{t / len(heads):6.2f} s/head (~{t / len(heads) * L * H / 60:.0f} min for all heads), peak {mib(m)}; "
              f"acc {', '.join(f'{h}={a:.4f}' for h, a in zip(heads, accs))}; dense would hold {V * V * 4 / 2 ** 30:.1f} GiB")

    comp, t_c, m_c = timed(lambda: qk.composition_scores(model, "K"))
    print(f"K-composition [L,H,L,H] + baseline {comp.baseline:.4f}: {t_c:.2f} s, peak {mib(m_c)}")
    col, t_col, m_col = timed(lambda: qk.weights.composition_column(model, qk.Head(L - 1, 0), "K"))
    print(f"K-composition of one head ({L - 1}.0) with all earlier heads: {t_col:.2f} s, peak {mib(m_col)}")
    n = args.tl_comp_layers
    ours_n, t_on, m_on = timed(lambda: qk.composition_scores(_first_layers(model, n), "K"))
    tlc, t_tlc, m_tlc = timed(lambda: tl_composition(model, n))
    mask = ~torch.isnan(ours_n.raw)
    d = float((tlc[mask] - ours_n.raw[mask]).abs().max())
    print(f"K-composition, first {n} layers ({n * H} heads): ours {t_on:.2f} s, peak {mib(m_on)} | TL "
          f"composition_scores (broadcast FactoredMatrix, no baseline) {t_tlc:.2f} s (x{t_tlc / t_on:.1f}), peak "
          f"{mib(m_tlc)} | max |raw diff| {d:.1e}")


class _first_layers:
    """A view of ``model`` with only its first ``n`` layers (enough for composition_scores)."""

    def __init__(self, model, n):
        import copy
        self.cfg = copy.copy(model.cfg)
        self.cfg.n_layers = n
        self.blocks = model.blocks[:n]


def tl_composition(model, n):
    """TL's own composition_scores on the first n layers (all_composition_scores on the whole model
    broadcasts [L,H,L,H, d_head, d_model] factors: ~10.7 GB for SmolLM2, more than this machine spares)."""
    from transformer_lens.FactoredMatrix import FactoredMatrix
    from transformer_lens.utilities.matrix import composition_scores

    ws = [qk.weights.layer_weights(model, layer) for layer in range(n)]
    left = FactoredMatrix(torch.stack([w.W_V for w in ws]), torch.stack([w.W_O for w in ws]))
    right = FactoredMatrix(torch.stack([w.W_Q for w in ws]), torch.stack([w.W_K for w in ws]).transpose(-1, -2)).T
    with torch.no_grad():
        return composition_scores(left, right, broadcast_dims=True)

if __name__ == "__main__":
    main()
