"""Train the tiny attention-only model that tests/test_detect.py checks the detectors on.

2 layers x 4 heads (d_head 16), d_model 64, LayerNorm, n_ctx 64, vocab 64; sequences are
[BOS, r1..rL, r1..rL, ...] with L drawn from 4..31 per sequence, so predicting the repeats needs
an induction circuit: a layer-0 previous-token head and layer-1 induction heads (REFERENCE.md:
they appear in ~300-600 steps; ~1,900 steps give induction ~0.9). Writes safetensors (no pickle)
beside the config it was trained with:

    python scripts/train_toy_induction.py --steps 2000 --out tests/fixtures/toy_induction
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformer_lens.config import TransformerBridgeConfig
from transformer_lens.model_bridge import TransformerBridge

CONFIG = dict(d_model=64, d_head=16, n_layers=2, n_ctx=64, n_heads=4, d_vocab=64, attn_only=True,
              normalization_type="LN", positional_embedding_type="standard", act_fn="relu",
              default_prepend_bos=False, model_name="toy-induction-trained")
BOS = 0


def build(seed: int = 0) -> TransformerBridge:
    torch.manual_seed(seed)
    return TransformerBridge.boot_native(TransformerBridgeConfig(**CONFIG, seed=seed), device="cpu")


def batch(g: torch.Generator, size: int = 16) -> torch.Tensor:
    n, V = CONFIG["n_ctx"], CONFIG["d_vocab"]
    rows = []
    for _ in range(size):
        L = int(torch.randint(4, 32, (1,), generator=g))
        seg = torch.randperm(V - 1, generator=g)[:L] + 1           # ids 1..V-1, BOS excluded, distinct
        rows.append(torch.cat([torch.tensor([BOS]), seg.repeat(n // L + 1)[: n - 1]]))
    return torch.stack(rows)


def train(steps: int, seed: int = 0) -> TransformerBridge:
    model = build(seed)
    native = model.original_model
    native.train()
    opt = torch.optim.AdamW(native.parameters(), lr=3e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    t0 = time.time()
    for step in range(steps):
        toks = batch(g)
        logits = native(toks)
        logits = logits[0] if isinstance(logits, tuple) else logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), toks[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 200 == 0 or step == steps - 1:
            print(f"step {step:5d} loss {loss.item():.3f} ({time.time() - t0:.0f} s)")
    native.eval()
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="tests/fixtures/toy_induction")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = train(args.steps, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # named_parameters() drops the aliases the bridge's wrappers add to the state dict.
    state = {k: v.detach().contiguous() for k, v in model.original_model.named_parameters()}
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**CONFIG, "steps": args.steps, "seed": args.seed}, indent=1))
    print(f"wrote {out}")


def load_trained(folder: str | Path) -> TransformerBridge:
    """Rebuild the architecture and load the trained weights (safetensors, no pickle)."""
    from safetensors.torch import load_file

    model = build()
    params = dict(model.original_model.named_parameters())
    state = load_file(str(Path(folder) / "model.safetensors"))
    if set(state) != set(params):
        raise ValueError(f"weights do not match the architecture: {sorted(set(state) ^ set(params))[:5]}")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)
    model.eval()
    return model


if __name__ == "__main__":
    main()
