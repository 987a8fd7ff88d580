"""Find the induction heads of GPT-2 (or any model qkcircuits can load) in a few lines.

    python scripts/find_induction_heads.py                       # gpt2 (needs the hub or its local cache)
    python scripts/find_induction_heads.py --model smollm2-135m  # offline: the GGUF shipped on PyPI
    python scripts/find_induction_heads.py --model path/to/hf_folder_or.gguf

Expected for GPT-2 small (ARENA): 5.1, 5.5, 6.9, 7.2, 7.10.
"""

import argparse

import qkcircuits as qk

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="gpt2")
parser.add_argument("--top", type=int, default=5)
args = parser.parse_args()

model = qk.load(args.model)
scores = qk.scan(model, confirm_top=args.top)          # one streamed pass per prompt set, then a causal check

print("induction heads (score >= 0.4):", ", ".join(map(str, scores.heads_labelled("induction"))) or "none")
for head, score in scores.top(args.top, "induction"):
    print(f"  {head}: induction {score:.2f}, prefix matching {float(scores['prefix_matching'][head.layer, head.head]):.2f}")
conf = scores.extras["confirmation"]
print(f"ablating them raises the repeated-half loss by {conf['effect']:+.2f} nats "
      f"(random sets of {args.top} heads: at most {max(conf['random_effects']):+.2f})")
