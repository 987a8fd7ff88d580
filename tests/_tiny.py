"""Builders for tiny checkpoints written to disk in seconds, with fixed seeds and no network.

>>> folder = tiny_gpt2(tmp / "gpt2")                 # doctest: +SKIP  config + safetensors + tokenizer
>>> folder = tiny_llama_gqa(tmp / "llama")           # doctest: +SKIP  4 query heads, 2 KV heads, rotary
>>> path = tiny_gguf(tmp / "llama.gguf", folder)     # doctest: +SKIP  the same Llama as an F32 GGUF
>>> folder = tiny_llama_mqa(tmp / "mqa")             # doctest: +SKIP  one KV head for all 4 query heads
>>> folder = tiny_gemma3(tmp / "gemma3")             # doctest: +SKIP  QK-norm, sliding window, rotary per layer type
>>> folder = tiny_gemma2(tmp / "gemma2")             # doctest: +SKIP  attention and FINAL logit soft-caps, post-norms
>>> folder = tiny_cohere(tmp / "cohere")             # doctest: +SKIP  interleaved rotary pairs, parallel blocks
>>> folder = tiny_cohere_qknorm(tmp / "cohere_qk")   # doctest: +SKIP  + a per-head LayerNorm QK-norm
>>> folder = tiny_smollm3(tmp / "smollm3")           # doctest: +SKIP  a position-free (NoPE) middle layer
>>> folder = tiny_gptneo(tmp / "gptneo")             # doctest: +SKIP  unscaled scores, a local (windowed) layer
>>> folder = tiny_neox(tmp / "neox")                 # doctest: +SKIP  parallel blocks, partial rotary (Pythia)
>>> folder = tiny_gptj(tmp / "gptj")                 # doctest: +SKIP  parallel blocks sharing one norm

Every checkpoint carries a REAL byte-level BPE tokenizer trained on ``qkcircuits.natural_text()``
(400 tokens, ``<|endoftext|>`` = id 0 as BOS/EOS), so text maps to many distinct ids; REFERENCE.md's
empty-tokenizer trap is asserted against (``len(tokenizer) > 1``). Weights are HF's random init with
every norm weight and bias perturbed, so LayerNorm folding and biases are exercised, not identities.

The ``*_dir`` helpers cache one copy per test session (keyed by name) under a session tmp dir, so
several test modules share one build. Sizes: each checkpoint is < 200 kB.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Dict

import numpy as np
import torch

VOCAB = 400
SPECIAL = "<|endoftext|>"
N_CTX = 64
LLAMA_THETA = 500.0   # not TL's default 10000: a hand-rebuilt rotary that ignores the HF config fails
SEED = 0


def bpe_tokenizer(vocab_size: int = VOCAB, add_bos: bool = False):
    """A GPT-2-style byte-level BPE tokenizer trained on the packaged natural text (deterministic). ``add_bos``:
    ``tokenizer(text)`` puts ``<|endoftext|>`` (id 0) first, as Llama's and Gemma's tokenizers put their BOS
    (``add_bos_token=True``, kept by save_pretrained); by default it adds nothing, as GPT-2's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2TokenizerFast

    from qkcircuits import natural_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[SPECIAL], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([natural_text()], trainer)
    fast = GPT2TokenizerFast(tokenizer_object=tok, bos_token=SPECIAL, eos_token=SPECIAL, unk_token=SPECIAL,
                             add_bos_token=add_bos)
    assert len(fast) == vocab_size > 1, "empty tokenizer (REFERENCE.md trap)"
    assert len(set(fast("attention heads move information")["input_ids"])) > 1
    assert (fast("a b")["input_ids"][0] == 0) == add_bos
    return fast


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Make norm weights != 1 and biases != 0 so folding and biases are really tested."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".ln_" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))


def tiny_gpt2(folder: Path, *, tokenizer=None) -> Path:
    """GPT-2: 2 layers, 4 heads x 8, d_model 32, n_ctx 64, vocab 400, learned positions, biases."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = tokenizer if tokenizer is not None else bpe_tokenizer()
    cfg = GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=N_CTX, vocab_size=len(tok), initializer_range=0.2,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(cfg).eval()
    _perturb(model, SEED)
    return _save(folder, model, tok)


def tiny_llama_gqa(folder: Path, *, tokenizer=None) -> Path:
    """Llama: 2 layers, 4 query heads, 2 KV heads, d_head 8, rotary theta 500, RMSNorm, untied."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer if tokenizer is not None else bpe_tokenizer()
    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=64, max_position_embeddings=N_CTX, vocab_size=len(tok),
                      initializer_range=0.2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": LLAMA_THETA},
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(SEED + 1)
    model = LlamaForCausalLM(cfg).eval()
    _perturb(model, SEED + 1)
    return _save(folder, model, tok)


def tiny_llama_mqa(folder: Path, *, tokenizer=None) -> Path:
    """Llama with ONE KV head (multi-query attention): 4 query heads share every K and V; theta 700."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer if tokenizer is not None else bpe_tokenizer()
    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                      intermediate_size=64, max_position_embeddings=N_CTX, vocab_size=len(tok),
                      initializer_range=0.2, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 700.0},
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(SEED + 3)
    model = LlamaForCausalLM(cfg).eval()
    _perturb(model, SEED + 3)
    return _save(folder, model, tok)


GEMMA3_THETAS = {"sliding_attention": 300.0, "full_attention": 5000.0}
GEMMA3_WINDOW = 6


def tiny_gemma3(folder: Path, *, tokenizer=None) -> Path:
    """Gemma-3 text model: 3 layers (sliding, sliding, full), 4 query heads, 2 KV heads, d_head 8, QK-norm
    (RMS q_norm/k_norm inside attention), sliding window 6, per-layer-type rotary (thetas 300 / 5000:
    transformers 5 keeps ``sliding_attention_inv_freq`` and ``full_attention_inv_freq``, no ``inv_freq``),
    ``query_pre_attn_scalar`` 6 (scale 1/√6, not 1/√d_head), pre- and post-attention norms, tied embeddings."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tok = tokenizer if tokenizer is not None else bpe_tokenizer()
    cfg = Gemma3TextConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, intermediate_size=64, max_position_embeddings=N_CTX, vocab_size=len(tok),
                           initializer_range=0.2, rms_norm_eps=1e-6, sliding_window=GEMMA3_WINDOW,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           rope_parameters={k: {"rope_type": "default", "rope_theta": v}
                                            for k, v in GEMMA3_THETAS.items()},
                           query_pre_attn_scalar=6, tie_word_embeddings=True, pad_token_id=tok.bos_token_id,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(SEED + 2)
    model = Gemma3ForCausalLM(cfg).eval()
    _perturb(model, SEED + 2)
    return _save(folder, model, tok)


GEMMA2_FINAL_CAP = 3.0           # small enough to bend a tiny random model's logits (|logit| ~ 1-4)


def tiny_gemma2(folder: Path, *, tokenizer=None) -> Path:
    """Gemma-2: 2 layers (sliding window 6, then full), 4 query heads, 2 KV heads, d_head 8, attention logit
    soft-cap 5 and FINAL logit soft-cap 3 (``logits = 3 tanh(logits / 3)`` after the unembedding, applied by the
    model's forward), ``query_pre_attn_scalar`` 6, pre- and post-norms (RMS with 1 + w), tied embeddings."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    tok = tokenizer if tokenizer is not None else bpe_tokenizer()
    cfg = Gemma2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, intermediate_size=64, max_position_embeddings=N_CTX, vocab_size=len(tok),
                       initializer_range=0.2, rms_norm_eps=1e-6, sliding_window=GEMMA3_WINDOW,
                       layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=5.0,
                       final_logit_softcapping=GEMMA2_FINAL_CAP, query_pre_attn_scalar=6, tie_word_embeddings=True,
                       pad_token_id=tok.bos_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(SEED + 7)
    model = Gemma2ForCausalLM(cfg).eval()
    _perturb(model, SEED + 7)
    return _save(folder, model, tok)


def _tiny_family(folder: Path, config_cls: str, model_cls: str, seed: int, tokenizer=None, **kw) -> Path:
    import transformers

    tok = tokenizer if tokenizer is not None else bpe_tokenizer()
    cfg = getattr(transformers, config_cls)(vocab_size=len(tok), initializer_range=0.2, bos_token_id=tok.bos_token_id,
                                            eos_token_id=tok.eos_token_id, **kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    _perturb(model, seed)
    return _save(folder, model, tok)


def tiny_cohere(folder: Path, *, tokenizer=None) -> Path:
    """Cohere: INTERLEAVED rotary pairs (2k, 2k+1), no QK-norm (its bridge declares hook_q_normed but never
    fires it then), parallel attention and MLP on one LayerNorm, 2 layers, 4 query / 2 KV heads."""
    return _tiny_family(folder, "CohereConfig", "CohereForCausalLM", SEED + 8, tokenizer, hidden_size=32,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                        max_position_embeddings=N_CTX, pad_token_id=0,
                        rope_parameters={"rope_type": "default", "rope_theta": 600.0})


def tiny_cohere_qknorm(folder: Path, *, tokenizer=None) -> Path:
    """Cohere with its QK-norm on: a LayerNorm per head (weights [heads, d_head], centring each head's query and key
    on its own), interleaved rotary after it, parallel blocks; 2 layers, 4 query / 2 KV heads."""
    return _tiny_family(folder, "CohereConfig", "CohereForCausalLM", SEED + 11, tokenizer, hidden_size=32,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                        max_position_embeddings=N_CTX, pad_token_id=0, use_qk_norm=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 600.0})


def tiny_bloom(folder: Path, *, tokenizer=None) -> Path:
    """Bloom: ALiBi (no position embedding: the score gains slope_h · key position), fused per-head qkv with biases,
    LayerNorm on the embeddings too; 2 layers, 4 heads x 8."""
    return _tiny_family(folder, "BloomConfig", "BloomForCausalLM", SEED + 12, tokenizer, hidden_size=32, n_layer=2,
                        n_head=4)


def tiny_smollm3(folder: Path, *, tokenizer=None) -> Path:
    """SmolLM3: 3 layers whose middle one is position-free (``no_rope_layers`` = [1, 0, 1]: NoPE, no rotary),
    4 query / 2 KV heads, RMSNorm, gated MLP."""
    return _tiny_family(folder, "SmolLM3Config", "SmolLM3ForCausalLM", SEED + 9, tokenizer, hidden_size=32,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                        max_position_embeddings=N_CTX, pad_token_id=0, no_rope_layers=[1, 0, 1],
                        rope_parameters={"rope_type": "default", "rope_theta": 600.0})


GPTNEO_WINDOW = 4


def tiny_gptneo(folder: Path, *, tokenizer=None) -> Path:
    """GPT-Neo: learned positions, UNSCALED scores (softmax(q·k), no 1/√d_head), layer 0 global and layer 1 local
    (keys fewer than ``window_size`` = 4 positions back), 4 heads x 8."""
    return _tiny_family(folder, "GPTNeoConfig", "GPTNeoForCausalLM", SEED + 10, tokenizer, hidden_size=32,
                        num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
                        window_size=GPTNEO_WINDOW, max_position_embeddings=N_CTX)


def tiny_neox(folder: Path, *, tokenizer=None) -> Path:
    """GPT-NeoX / Pythia with PARALLEL blocks (``resid + attn(ln1(resid)) + mlp(ln2(resid))``): 2 layers, 4 heads
    x 8, fused per-head [q | k | v] projection with biases, partial rotary (half of each head's dims), LayerNorm."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    tok = tokenizer if tokenizer is not None else bpe_tokenizer()
    cfg = GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                        max_position_embeddings=N_CTX, vocab_size=len(tok), initializer_range=0.2, rotary_pct=0.5,
                        use_parallel_residual=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(SEED + 4)
    model = GPTNeoXForCausalLM(cfg).eval()
    _perturb(model, SEED + 4)
    return _save(folder, model, tok)


def tiny_gptj(folder: Path, *, tokenizer=None) -> Path:
    """GPT-J: PARALLEL blocks with ONE LayerNorm (ln_1) read by both attention and MLP, 2 layers, 4 heads x 8,
    interleaved rotary on 4 dims per head, no q/k/v biases."""
    from transformers import GPTJConfig, GPTJForCausalLM

    tok = tokenizer if tokenizer is not None else bpe_tokenizer()
    cfg = GPTJConfig(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=N_CTX, n_inner=64,
                     vocab_size=len(tok), initializer_range=0.2, bos_token_id=tok.bos_token_id,
                     eos_token_id=tok.eos_token_id)
    torch.manual_seed(SEED + 5)
    model = GPTJForCausalLM(cfg).eval()
    _perturb(model, SEED + 5)
    return _save(folder, model, tok)


def tiny_olmo2(folder: Path) -> Path:
    """OLMo-2: norms AFTER attention and MLP only (no norm before either) and a QK-norm over the full
    n_heads x d_head width, so no head's query is a function of that head's weights alone: refused."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    tok = bpe_tokenizer()
    cfg = Olmo2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      intermediate_size=64, max_position_embeddings=N_CTX, vocab_size=len(tok),
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None)
    torch.manual_seed(SEED + 6)
    return _save(folder, Olmo2ForCausalLM(cfg).eval(), tok)


def tiny_unsupported(folder: Path) -> Path:
    """A causal LM architecture TransformerLens has no adapter for (BigBird), saved like any checkpoint."""
    from transformers import BigBirdConfig, BigBirdForCausalLM

    tok = bpe_tokenizer()
    cfg = BigBirdConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=N_CTX, attention_type="original_full",
                        is_decoder=True)
    torch.manual_seed(SEED)
    return _save(folder, BigBirdForCausalLM(cfg).eval(), tok)


def one_id_tokenizer(vocab=("[UNK]",)):
    """A tokenizer whose every input maps to the same id: ``vocab`` only, everything else is [UNK]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


def _save(folder: Path, model, tok) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    return folder


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (transformers' GGUF loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_gguf(path: Path, llama_folder: Path) -> Path:
    """Write the Llama in ``llama_folder`` as an F32 GGUF (llama.cpp tensor names, gpt2 BPE tokenizer metadata).

    Mirrors llama.cpp's convert_hf_to_gguf: q/k rows permuted, vocab/merges/token types from the
    tokenizer, BOS/EOS ids. transformers' ``gguf_file=`` loader must give back the same weights.
    """
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(llama_folder)
    tok = AutoTokenizer.from_pretrained(llama_folder)
    sd = {k: v.float().numpy() for k, v in load_file(str(Path(llama_folder) / "model.safetensors")).items()}
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama-gqa")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    # Tokenizer: byte-level BPE, exactly as llama.cpp writes a GPT-2-style vocabulary.
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens))) == list(range(cfg.vocab_size))
    special = set(tok.all_special_tokens)
    merges = [" ".join(m) if not isinstance(m, str) else m
              for m in __import__("json").loads(tok.backend_tokenizer.to_str())["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_add_bos_token(False)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
                 "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    assert set(names) == set(sd), set(sd) ^ set(names)
    for hf, gg in names.items():
        arr = sd[hf]
        if ".attn_q." in gg:
            arr = _llama_cpp_permute(arr, cfg.num_attention_heads)
        elif ".attn_k." in gg:
            arr = _llama_cpp_permute(arr, cfg.num_key_value_heads)
        w.add_tensor(gg, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def truncated_copy(src: Path, dst: Path, keep: float = 0.6) -> Path:
    """The first ``keep`` share of ``src``'s bytes: a download cut off mid-way."""
    data = Path(src).read_bytes()
    Path(dst).write_bytes(data[: int(len(data) * keep)])
    return Path(dst)


# ---- one build per test session, shared by every module that imports these ----------------------

_BUILT: Dict[str, Path] = {}


def _once(key: str, tmp_path_factory, build: Callable[[Path], Path]) -> Path:
    if key not in _BUILT or not _BUILT[key].exists():
        _BUILT[key] = build(tmp_path_factory.mktemp(key))
    return _BUILT[key]


def gpt2_dir(tmp_path_factory) -> Path:
    return _once("gpt2", tmp_path_factory, lambda d: tiny_gpt2(d))


def gpt2_bos_dir(tmp_path_factory) -> Path:
    """The tiny GPT-2 (same weights) with a tokenizer that prepends its BOS on its own (``add_bos_token=True``)."""
    return _once("gpt2_bos", tmp_path_factory, lambda d: tiny_gpt2(d, tokenizer=bpe_tokenizer(add_bos=True)))


def llama_dir(tmp_path_factory) -> Path:
    return _once("llama", tmp_path_factory, lambda d: tiny_llama_gqa(d))


def llama_mqa_dir(tmp_path_factory) -> Path:
    return _once("llama_mqa", tmp_path_factory, lambda d: tiny_llama_mqa(d))


def gemma3_dir(tmp_path_factory) -> Path:
    return _once("gemma3", tmp_path_factory, lambda d: tiny_gemma3(d))


def gemma2_dir(tmp_path_factory) -> Path:
    return _once("gemma2", tmp_path_factory, lambda d: tiny_gemma2(d))


def neox_dir(tmp_path_factory) -> Path:
    return _once("neox", tmp_path_factory, lambda d: tiny_neox(d))


def gptj_dir(tmp_path_factory) -> Path:
    return _once("gptj", tmp_path_factory, lambda d: tiny_gptj(d))


def gguf_path(tmp_path_factory) -> Path:
    return _once("gguf", tmp_path_factory, lambda d: tiny_gguf(d / "tiny-llama.F32.gguf", llama_dir(tmp_path_factory)))


def hf_model(folder: Path):
    """transformers' own model for ``folder`` (float32, eval): the reference the bridge is compared with."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return Path(dst)


_SMOLLM2_HF: list = []


def smollm2_hf():
    """transformers' own SmolLM2-135M from the cached GGUF (float32, eval), one per session (~13 s)."""
    if not _SMOLLM2_HF:
        from transformers import AutoModelForCausalLM

        from qkcircuits._foundation.fetch import smollm2_gguf

        path = smollm2_gguf(quiet=True)
        _SMOLLM2_HF.append(AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                dtype=torch.float32).eval())
    return _SMOLLM2_HF[0]


# ---- DeepSeek (multi-head latent attention) -------------------------------------------------------

MLA_SHAPE = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                 kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                 intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                 num_experts_per_tok=2, first_k_dense_replace=1)
DEEPSEEK_THETA = 800.0
YARN = {"rope_type": "yarn", "rope_theta": DEEPSEEK_THETA, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}


def tiny_deepseek(folder: Path, *, version: int = 3, q_lora_rank=32, yarn: bool = False, tokenizer=None) -> Path:
    """DeepSeek-V2 or -V3 (multi-head latent attention): 3 layers, hidden 64, 4 heads, kv_lora_rank 16,
    ``q_lora_rank`` 32 (or None: a plain q_proj), rotary dim 8 + no-rotary dim 16 per head, v_head_dim 16,
    MoE MLPs from layer 1 (4 routed experts, top-2, one shared). V3 rotates interleaved pairs
    (``rope_interleave``), V2 its complex-exponential pairs. ``yarn`` sets YaRN rope scaling (factor 4,
    mscale_all_dim 1: HF's score scale becomes qk_head_dim^-0.5 · mscale², not 1/√24)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    tok = tokenizer if tokenizer is not None else bpe_tokenizer()
    rope = dict(YARN) if yarn else {"rope_type": "default", "rope_theta": DEEPSEEK_THETA}
    common = dict(MLA_SHAPE, q_lora_rank=q_lora_rank, max_position_embeddings=N_CTX, vocab_size=len(tok),
                  initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters=rope,
                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.bos_token_id)
    if version == 3:
        cfg, cls = DeepseekV3Config(**common, rope_interleave=True, n_group=1, topk_group=1), DeepseekV3ForCausalLM
    else:
        cfg, cls = DeepseekV2Config(**common, n_group=1, topk_group=1, topk_method="greedy"), DeepseekV2ForCausalLM
    torch.manual_seed(SEED + 10 + version)
    model = cls(cfg).eval()
    _perturb(model, SEED + 10 + version)
    return _save(folder, model, tok)


def deepseek_dir(tmp_path_factory, version: int = 3, q_lora_rank=32, yarn: bool = False) -> Path:
    key = f"deepseek_v{version}_q{q_lora_rank}{'_yarn' if yarn else ''}"
    return _once(key, tmp_path_factory, lambda d: tiny_deepseek(d, version=version, q_lora_rank=q_lora_rank,
                                                                 yarn=yarn))


def contrast_task(model, n: int = 16, p: int = 10, seed: int = 0):
    """Minimal pairs on random tokens: corrupt = clean with the token at position p-2 resampled; answer / wrong =
    the tokens whose END logit the clean token raises / lowers most against the corrupt one (a behaviour any
    random model has, so a task circuit exists on every tiny family)."""
    import qkcircuits as qk

    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(1, model.cfg.d_vocab, (n, p), generator=g)
    corrupt = clean.clone()
    corrupt[:, p - 2] = torch.randint(1, model.cfg.d_vocab, (n,), generator=g)
    with torch.no_grad():
        d = model(clean)[:, -1] - model(corrupt)[:, -1]
    return qk.Task(clean, corrupt, d.argmax(-1), d.argmin(-1))
