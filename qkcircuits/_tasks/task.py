"""A task: clean and corrupt prompts of the same shape, the answer and the wrong token, a metric.

>>> task = qk.tasks.induction(model, n=4, seg_len=6, seed=0)
>>> task.clean.shape == task.corrupt.shape, task.metric.name, task.bos
(True, 'logit-diff', True)
>>> sorted(task.positions)
['END']

Every metric is computed per prompt row and *summed* (``row_values``); a mean is the sum over all
rows divided by ``n``. So a prompt shard's sums add up exactly to the whole set's, which is what
edge scores and faithfulness rely on when they split the prompts.

``task.metric`` is always a ``qk.Metric``, resolved by ``as_metric(..., prompts=TASK)`` (the one resolver, over
the one table of names ``_foundation/metric_table``) whenever it is set. Task metrics read the logits at each row's
``END`` position, the last real token (rows shorter than the longest are right-padded, which a causal model
never sees from positions ≤ END):

- ``"logit-diff"`` (default): logit[answer] − logit[wrong]; with answer sets the mean logit of the answer set −
  the mean of the wrong set;
- ``"prob-diff"``: p(answer) − p(wrong) after a softmax over the vocabulary; with sets Σ p(answer set) −
  Σ p(wrong set) (Hanna et al. 2023's greater-than metric);
- ``"answer-loss"``: −log p(answer), with a set −log Σ p(answer set) (lower is better: faithfulness is a ratio, so the sign cancels there; a
  signed circuit ranks edges by −score, the direction that carries the behaviour);
- ``"kl"``: KL(p_clean ‖ p) = Σ_v p_clean(v) (log p_clean(v) − log p(v)) at END, p_clean the clean run's
  next-token distribution (``reference``, filled by ``with_reference``: every entry point does it); lower is
  better, 0 on the clean run. Its gradient at the clean run is 0, so EAP (and EAP-IG's right rule at its last
  point) gets nothing from that point;
- any metric on token rows (``text-loss``, ``logit-diff:C,W``, a ``qk.Metric``, a callable ``fn(logits [b, pos,
  vocab], tokens [b, pos]) -> scalar`` with its direction declared: ``qk.as_metric(fn, higher_is_better=...)``):
  a mean over the batch, taken once per stacked copy (each copy is its own run), so a copy's row sum is
  ``fn(copy) × n``. A callable without a direction is refused.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from .._foundation.args import check_tokens
from .._foundation.arch.model_facts import default_bos_id
from .._foundation.errors import QKCircuitsError
from .._analysis.metrics import TASK, Metric, as_metric, is_builtin, reads_reference
from .answers import AnswerLike, answer_ids, repeat_rows, row_ids

BOS_MODES = ("auto", "yes", "no")
PATTERNS = (None, "induction")      # Task.pattern: the rows a head is read at when the task names no position


@dataclass
class Task:
    """Clean and corrupt token rows [n, pos] (same shape, checked), per-row ``answer``/``wrong`` token
    ids [n] or token-id sets [n, k] (ragged sets padded with -1: ``_tasks/answers.py``), a ``metric`` (a name, ``qk.Metric`` or declared callable, stored as the ``Metric``; see the module
    docstring), named positions per row (``positions[name]`` is
    a [n] tensor of indices; ``END`` is where the metric reads and defaults to the last position), a
    ``name``, whether a BOS token was prepended (``bos``), the prompt texts when built from text, how the BOS
    was decided (``bos_mode``: "auto" = what the tokenizer does on its own, "yes"/"no" = forced; None for a
    task built from ids, described as "yes"/"no" by ``bos``) and, for ``metric="kl"``, the clean run's
    log-probabilities at END (``reference`` [n, vocab]: ``with_reference`` fills it) and, for a task whose rows
    are read by a pattern rather than named positions, that pattern (``pattern``: ``"induction"`` for
    ``qk.tasks.induction``, each repeated token → the token after its earlier copy; ``qk.attend`` and the roles'
    QK evidence read it)."""

    # what __init__ accepts (ids as tensors or nested lists; one answer id for every row, one per row, or a set
    # of ids per row: answers.answer_ids); __post_init__ stores [n, pos] and [n] or [n, k] (PAD-padded sets) tensors
    clean: Union[Int[Tensor, "n pos"], Sequence[Sequence[int]]]
    corrupt: Union[Int[Tensor, "n_corrupt pos_corrupt"], Sequence[Sequence[int]]]   # == clean's shape: checked below, one line
    answer: AnswerLike
    wrong: AnswerLike
    metric: Union[str, Metric, Callable] = "logit-diff"     # stored as the resolved Metric (__setattr__)
    positions: Dict[str, Tensor] = field(default_factory=dict)
    name: str = "custom"
    bos: bool = False
    prompts: Optional[List[str]] = None
    bos_mode: Optional[str] = None
    reference: Optional[Tensor] = None
    pattern: Optional[str] = None       # the rows a head is read at when no position is named ("induction")

    def __post_init__(self) -> None:
        check_tokens(self.clean, "clean"), check_tokens(self.corrupt, "corrupt")     # ids, not text or floats
        self.clean, self.corrupt = torch.as_tensor(self.clean).long(), torch.as_tensor(self.corrupt).long()
        if self.clean.dim() != 2 or self.clean.shape != self.corrupt.shape:
            raise QKCircuitsError(f"clean and corrupt must be token tensors of the same shape [n, pos]; got "
                                  f"{tuple(self.clean.shape)} and {tuple(self.corrupt.shape)}")
        n = self.clean.shape[0]
        if n < 1:
            raise QKCircuitsError("a task needs at least one prompt row")
        self.answer, self.wrong = answer_ids(self.answer, n, "answer"), answer_ids(self.wrong, n, "wrong")
        if self.pattern not in PATTERNS:
            raise QKCircuitsError(f"pattern must be None (the task's named positions) or one of "
                                  f"{', '.join(p for p in PATTERNS if p)}, got {self.pattern!r}")
        if self.bos_mode is not None and self.bos_mode not in BOS_MODES:
            raise QKCircuitsError(f"bos_mode must be one of {', '.join(BOS_MODES)} or None, got {self.bos_mode!r}")
        if self.reference is not None and (self.reference.dim() != 2 or self.reference.shape[0] != n):
            raise QKCircuitsError(f"reference must be the clean log-probabilities at END, [{n}, vocab]; got "
                                  f"{tuple(self.reference.shape)}")
        pos = {k: torch.as_tensor(v).long().reshape(-1) for k, v in self.positions.items()}
        pos.setdefault("END", torch.full((n,), self.clean.shape[1] - 1, dtype=torch.long))
        for k, v in pos.items():
            if v.shape != (n,) or int(v.min()) < 0 or int(v.max()) >= self.clean.shape[1]:
                raise QKCircuitsError(f"position {k!r} must give one index in 0-{self.clean.shape[1] - 1} per row")
        self.positions = pos

    def __setattr__(self, key: str, value) -> None:
        if key == "metric":                 # set in __init__ or later: always the resolved Metric
            value = as_metric(value, accept=("logits",), prompts=TASK, where="a task")
        object.__setattr__(self, key, value)

    # ---------------------------------------------------------------------------------------- rows

    @property
    def n(self) -> int:
        return int(self.clean.shape[0])

    @property
    def metric_name(self) -> str:
        return self.metric.name

    @property
    def higher_is_better(self) -> bool:
        """The metric's declared direction (``Metric.higher_is_better``)."""
        return self.metric.higher_is_better

    def rows(self, index: Union[slice, Sequence[int], Tensor]) -> "Task":
        """The sub-task of some prompt rows (a shard): its metric sums add up to the whole task's."""
        idx = torch.arange(self.n)[index] if isinstance(index, slice) else torch.as_tensor(index).long()
        ref = None if self.reference is None else self.reference[idx.to(self.reference.device)]
        return Task(self.clean[idx], self.corrupt[idx], self.answer[idx], self.wrong[idx], self.metric,
                    {k: v[idx] for k, v in self.positions.items()}, self.name, self.bos,
                    [self.prompts[i] for i in idx.tolist()] if self.prompts else None, self.bos_mode, ref,
                    self.pattern)

    def at_end(self) -> "Task":
        """The same rows with END = 0: for logits already taken at each row's END position ([b, 1, vocab])."""
        return Task(self.clean[:, :1], self.corrupt[:, :1], self.answer, self.wrong, self.metric, {}, self.name,
                    self.bos, None, self.bos_mode, self.reference, self.pattern)

    def shards(self, rows_per_shard: int) -> List["Task"]:
        return [self.rows(slice(i, i + rows_per_shard)) for i in range(0, self.n, max(1, rows_per_shard))]

    def to(self, device) -> "Task":
        return Task(self.clean.to(device), self.corrupt.to(device), self.answer.to(device), self.wrong.to(device),
                    self.metric, {k: v.to(device) for k, v in self.positions.items()}, self.name, self.bos,
                    self.prompts, self.bos_mode, None if self.reference is None else self.reference.to(device),
                    self.pattern)

    # ---------------------------------------------------------------------------------------- metric

    def row_values(self, logits: Float[Tensor, "b pos vocab"], tokens: Optional[Tensor] = None
                   ) -> Float[Tensor, " b"]:
        """The metric of each row (differentiable). ``logits`` may be ``copies`` stacked batches
        (b = copies × n): rows repeat the task's answers. A metric on token rows (not a task metric) gives each
        row its copy's batch mean."""
        b = logits.shape[0]
        copies = b // self.n
        if copies * self.n != b:
            raise QKCircuitsError(f"logits for {b} rows do not stack copies of this task's {self.n} rows")
        if self.metric.prompts != "task":
            # a batch mean per copy: stacked copies are different runs (one per patched edge), never one batch
            toks = tokens if tokens is not None else self.clean.repeat(copies, 1)
            n = self.n
            return torch.cat([self.metric(logits[i * n:(i + 1) * n], toks[i * n:(i + 1) * n]).expand(n)
                              for i in range(copies)])
        rows = torch.arange(b, device=logits.device)
        end = self.positions["END"].to(logits.device).repeat(copies)
        last = logits[rows, end].float()                                        # [b, vocab]
        a, w = (repeat_rows(t.to(logits.device), copies) for t in (self.answer, self.wrong))
        ref = None if self.reference is None else self.reference.to(logits.device).float().repeat(copies, 1)
        return self.metric.rows(last, a, w, ref)                                # ref: [b, vocab] log p_clean

    def metric_sum(self, logits: Tensor, tokens: Optional[Tensor] = None) -> Tensor:
        return self.row_values(logits, tokens).sum()

    def digest(self, model) -> Optional[str]:
        """What the clean metric of this task on ``model`` depends on, as one hex string: the token rows,
        answers, END positions and metric name, the weights (per parameter a bilinear form vᵀ P u with fixed
        pseudo-random u, v > 0: editing a weight changes it, and so does moving values around, e.g. swapping
        two unembedding rows, which keeps every sum), their dtype and device type. None for a metric not in the table
        (its code is not hashable). ``qk.faithfulness`` reads m(clean) from scores whose digest equals this one instead of
        running the clean rows again."""
        if not is_builtin(self.metric):
            return None
        h = hashlib.sha1()
        for t in (self.clean, self.corrupt, self.answer, self.wrong, self.positions["END"]):
            if t.dim() > 1 and t is not self.clean and t is not self.corrupt:   # answer sets: their shape too
                h.update(repr(tuple(t.shape)).encode())
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        if self.reference is not None:
            h.update(self.reference.detach().float().cpu().contiguous().numpy().tobytes())
        with torch.no_grad():
            sums = [_fingerprint(p) for p in model.parameters()]
        w = model.W_E
        h.update(repr((self.metric.name, sums, str(w.dtype), w.device.type)).encode())
        return h.hexdigest()

    def describe(self) -> Dict[str, object]:
        """The JSON-ready description (no tensors)."""
        return {"name": self.name, "n_prompts": self.n, "seq_len": int(self.clean.shape[1]),
                "metric": self.metric_name, "higher_is_better": self.higher_is_better,
                "bos_prepended": bool(self.bos), "bos": self.bos_info(),
                "positions": sorted(self.positions)}

    def bos_info(self) -> Dict[str, object]:
        """``{"prepended": bool, "mode": "auto" | "yes" | "no"}`` (the circuit JSON's ``bos``): a task built from
        ids says "yes"/"no" by whether its rows start with a BOS."""
        return {"prepended": bool(self.bos), "mode": self.bos_mode or ("yes" if self.bos else "no")}


def _probe(n: int, salt: int, like: Tensor) -> Tensor:
    """A fixed pseudo-random vector of ``n`` entries in (0.5, 1.5) (seeded by n and salt), on ``like``'s device."""
    g = torch.Generator().manual_seed(n * 2 + salt)
    return (torch.rand(n, generator=g) + 0.5).to(device=like.device, dtype=like.dtype)


def _fingerprint(p: Tensor) -> float:
    """vᵀ P u of a parameter viewed as [rows, -1] (u, v > 0.5: editing any one weight changes it, and so does
    moving rows or columns around, which a plain sum would not see): one matrix-vector pass over the weights
    (SmolLM2: 0.07 s of CPU for all 135 M, against 0.26 s for a float64 sum)."""
    # in float32 at least: in bf16/fp16 each row's product would be rounded to 8/11 bits, and the probes would
    # take only a few hundred distinct values, so that small edits and swapped rows could leave it unchanged
    x = p.detach() if p.dtype in (torch.float32, torch.float64) else p.detach().float()
    x = x.reshape(x.shape[0], -1) if x.dim() > 1 else x.reshape(1, -1)
    return float(_probe(x.shape[0], 1, x).double() @ (x @ _probe(x.shape[1], 2, x)).double())


def with_reference(model, task: Task) -> Task:
    """``task`` ready for ``model``: for ``metric="kl"`` without a ``reference``, a copy holding the clean run's
    log-probabilities at each row's END ([n, vocab], float32; one no-grad forward per 16 rows); any other task
    as it is. Entry points (edge and node scores, faithfulness, ``qk.evaluate``, roles) call it."""
    if not reads_reference(task.metric) or task.reference is not None:
        return task
    dev = model.W_E.device
    parts = []
    with torch.no_grad():
        for shard in task.shards(16):
            logits = model(shard.clean.to(dev))
            logits = logits.logits if hasattr(logits, "logits") else logits
            rows = torch.arange(shard.n, device=logits.device)
            parts.append(F.log_softmax(logits[rows, shard.positions["END"].to(logits.device)].float(), -1).cpu())
    ref = torch.cat(parts)
    return Task(task.clean, task.corrupt, task.answer, task.wrong, task.metric, task.positions, task.name, task.bos,
                task.prompts, task.bos_mode, ref.to(task.clean.device), task.pattern)


def evaluate(model, task: Task, rows_per_shard: int = 16, warn: bool = True) -> Dict[str, float]:
    """The clean and corrupt metric means (two forwards per shard). Warns, does not fail, when the model
    does not do the task (clean ≤ corrupt for a higher-is-better metric)."""
    task = with_reference(model, task)
    sums = {"clean": 0.0, "corrupt": 0.0}
    with torch.no_grad():
        for shard in task.shards(rows_per_shard):
            for which in sums:
                toks = getattr(shard, which)
                sums[which] += float(shard.metric_sum(model(toks), toks))
    out = {k: v / task.n for k, v in sums.items()}
    if warn:
        warn_if_not_done(task, out["clean"], out["corrupt"], stacklevel=3, model=model)
    return out


NOT_DONE = "the model does not do task"


def does_the_task(task: Task, clean: float, corrupt: float) -> bool:
    """clean > corrupt for a higher-is-better metric, clean < corrupt for a loss."""
    return clean > corrupt if task.higher_is_better else clean < corrupt


def not_done_message(task: Task, clean: float, corrupt: float, model=None) -> str:
    """One line: the two means, then the likely causes a user can check, in the order they usually are: the BOS
    (what was prepended and how to change it), the answer tokens (row 0's, as text where the model has a
    tokenizer) and the metric's direction. Not a verdict on the model: each of these alone turns a model that
    does the task into one that seems not to."""
    better = "higher" if task.higher_is_better else "lower"
    how = {"auto": "auto: what the tokenizer does on its own", "yes": "forced", "no": "forced"}.get(
        task.bos_mode or "", "built from ids")
    if task.bos_mode is None:
        bos = (f"the rows {'start' if task.bos else 'do not start'} with a BOS (a task built from ids: "
               f"{'is it the one this model was trained with?' if task.bos else 'many models need one first'})")
    elif task.bos:
        bos = f"a BOS is prepended ({how}; --bos no / prepend_bos=False leaves it out)"
    else:
        bos = f"no BOS is prepended ({how}; --bos yes / prepend_bos=True adds one: many models need it)"
    tok = getattr(model, "tokenizer", None) if model is not None else None

    def word(i: int) -> str:
        try:
            return f"{tok.decode([i])!r} (id {i})" if tok is not None else f"id {i}"
        except Exception:     # a tokenizer that cannot decode this id: the id is enough
            return f"id {i}"
    def words(ids) -> str:
        got = row_ids(ids, 0)
        return word(got[0]) if len(got) == 1 else "{" + ", ".join(word(i) for i in got[:6]) + (
            ", …}" if len(got) > 6 else "}")
    answers = (f"the answer tokens (row 0: answer {words(task.answer)}, wrong {words(task.wrong)}: "
               f"is the answer the token the model should predict next, leading space included?)"
               if not reads_reference(task.metric) else "the corrupt prompts (they must change the next-token distribution)")
    return (f"{NOT_DONE} {task.name!r}: clean {task.metric_name} {clean:.4g} vs corrupt {corrupt:.4g} ({better} is "
            f"better). Likely causes to check: {bos}; {answers}; the metric's direction ({task.metric_name}: {better} "
            f"is better on the clean prompts; answer and wrong swapped?). Circuits, faithfulness and roles say little "
            f"until clean beats corrupt")


def warn_if_not_done(task: Task, clean: float, corrupt: float, stacklevel: int = 2, model=None) -> bool:
    """A ``UserWarning`` (not an error) when the model does not do the task (``does_the_task``), worded by
    ``not_done_message``; returns whether it does. ``evaluate``, ``qk.edge_scores`` and ``qk.node_scores`` call it
    with the means they measured."""
    done = does_the_task(task, clean, corrupt)
    if not done:
        warnings.warn(not_done_message(task, clean, corrupt, model), stacklevel=stacklevel + 1)
    return done


# -------------------------------------------------------------------------------------------- text helpers

def tokenizer_of(model):
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise QKCircuitsError("this model has no tokenizer; build the Task from token ids (qk.Task(clean, corrupt, "
                              "answer, wrong)) or use qk.tasks.induction")
    return tok


def bos_id(model) -> int:
    tok = getattr(model, "tokenizer", None)
    for cand in (getattr(tok, "bos_token_id", None), getattr(tok, "eos_token_id", None),
                 default_bos_id(model)):
        if isinstance(cand, int):
            return cand
    return 0


def bos_prefix(model, prepend_bos: Optional[bool]) -> Tuple[List[int], str]:
    """(the ids every prompt starts with, the mode "auto" | "yes" | "no") for ``prepend_bos`` None (what the
    model's tokenizer puts before a text on its own: ``own_tokenizer.own_affixes``, e.g. Llama's and Gemma's
    ``<bos>``, nothing for GPT-2's and SmolLM2's), True (one BOS, ``bos_id``) or False (nothing). What a tokenizer
    appends (an EOS) is never added: the metric reads the token that follows the prompt."""
    if prepend_bos is None:
        from .._foundation.own_tokenizer import own_affixes

        return [int(t) for t in own_affixes(model)["prefix"]], "auto"
    if not isinstance(prepend_bos, bool):
        raise QKCircuitsError(f"prepend_bos must be None (what the tokenizer does on its own), True or False, got "
                              f"{prepend_bos!r}")
    return ([bos_id(model)] if prepend_bos else []), ("yes" if prepend_bos else "no")


def bos_mode_arg(text: str) -> Optional[bool]:
    """The CLI's ``--bos auto|yes|no`` as ``prepend_bos`` (None, True, False)."""
    if text not in BOS_MODES:
        raise QKCircuitsError(f"--bos {text!r}: expected auto (what the tokenizer does on its own), yes or no")
    return {"auto": None, "yes": True, "no": False}[text]


def encode(model, text: str, prefix: Sequence[int] = ()) -> List[int]:
    """``text`` as token ids, the tokenizer's own special tokens left out, ``prefix`` (``bos_prefix``) first."""
    ids = list(tokenizer_of(model)(text, add_special_tokens=False)["input_ids"])
    return [int(t) for t in prefix] + ids


def pad_rows(model, rows: Sequence[Sequence[int]]) -> Tensor:
    """Right-pad token rows to one length with the pad (else EOS/BOS) id: a causal model's positions up to
    each row's END never see what follows, so padding changes none of the metric's logits."""
    tok = getattr(model, "tokenizer", None)
    pad = getattr(tok, "pad_token_id", None)
    pad = pad if isinstance(pad, int) else bos_id(model)
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=torch.long)
