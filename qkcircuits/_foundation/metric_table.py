"""The one table of metric names: what each name means, which way is better, what it reads, where it applies.

>>> row("answer-loss").higher_is_better, row("answer-loss").prompts
(False, 'task')
>>> names(prompts=TASK)
('logit-diff', 'prob-diff', 'answer-loss', 'kl', 'logit-diff:C,W', 'text-loss')
>>> direction_of("answer-loss"), direction_of("loss")      # "loss": a name files written before 0.2.0 carry
(False, False)

Plain data (no torch), so the CLI can check ``--metric`` before anything heavy loads. ``_analysis/metrics.py``
builds each built-in ``Metric`` from its row (direction, ``needs``, ``prompts``) and its function; the table in
docs/architecture.md ("Metrics") is this one, checked by tests/test_metric_vocabulary.py.

- ``needs``: what the metric reads from a forward: ``logits``; ``pattern`` / ``z``: one receiver head's (path
  patching only).
- ``prompts``: what it is defined on: ``any`` token rows; ``repeated``: ``[BOS] + R + R`` (``qk.repeated_tokens``);
  ``task``: a ``qk.Task``'s rows (an answer and a wrong token, or token set, per row, read at the row's ``END``).
- Where it applies: analyses given token rows (``ablate``, ``group_effect``, ``compare_to_random``, ``sweep``,
  ``attribution``, ``path_patch``, ``edge_attribution``, ``trace``; CLI ``ablate``) take ``prompts`` in
  ``TOKENS``; a task (``qk.Task``: ``evaluate``, ``edge_scores``, ``node_scores``, ``faithfulness``,
  ``core_circuit``, roles; CLI ``circuit``) takes ``prompts`` in ``TASK``. A receiver metric (pattern / z) only
  path patching, edge attribution and the trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

NEEDS = ("logits", "pattern", "z")
PROMPTS = {"any": "any token rows",
           "repeated": "[BOS] + R + R (qk.repeated_tokens)",
           "task": "a qk.Task's rows: an answer and a wrong token (or token set) per row, read at its END position"}
TOKENS = ("repeated", "any")    # the prompts of analyses given token rows (sweep, ablation, path patching, trace)
TASK = ("task", "any")          # the prompts of a qk.Task (edge / node scores, faithfulness, evaluate, core, roles)


@dataclass(frozen=True)
class Row:
    """One metric name: its direction (``higher_is_better``: larger = the behaviour is present), what it reads
    (``needs``), what prompts it is defined on (``prompts``) and its formula (``meaning``)."""

    name: str
    higher_is_better: bool
    needs: str
    prompts: str
    meaning: str


TABLE: Tuple[Row, ...] = (
    Row("induction-loss", False, "logits", "repeated",
        "mean −log p(next token) over the L−1 predictions of R[1:] in the second copy of [BOS]+R+R"),
    Row("induction-loss-first-half", False, "logits", "repeated",
        "the same over R[1:] of the first copy (the guessing level: ln(V−1) on uniform R)"),
    Row("logit-diff:C,W", True, "logits", "any",
        "mean over rows of logit[C] − logit[W] at position −1 (`@P`: position P); C, W token ids"),
    Row("text-loss", False, "logits", "any", "mean −log p(tokens[i+1] | tokens[≤i]) over every position"),
    Row("logit-diff", True, "logits", "task",
        "logit[answer] − logit[wrong] at END; with answer sets the mean logit of the answer set − the mean of the "
        "wrong set"),
    Row("prob-diff", True, "logits", "task",
        "p(answer) − p(wrong) at END (softmax over the vocabulary); with answer sets Σ p(answer set) − Σ p(wrong set)"),
    Row("answer-loss", False, "logits", "task", "−log p(answer) at END; with an answer set −log Σ p(answer set)"),
    Row("kl", False, "logits", "task",
        "KL(p_clean ‖ p) = Σ_v p_clean(v) (log p_clean(v) − log p(v)) at END; 0 on the clean run"),
    Row("induction", True, "pattern", "repeated",
        "a receiver head's attention on its induction targets, mean over the queries that have one"),
    Row("direct-logit", True, "z", "repeated",
        "mean over those queries of logit_t(lnf(x)) − logit_t(lnf(x − C)): the receiver's direct effect on the "
        "correct next token t"),
)
_ROWS: Dict[str, Row] = {r.name: r for r in TABLE}
# The names result files written before 0.2.0 may carry, with their direction (read from files only: analyses refuse
# them): "loss" meant the induction loss given tokens and −log p(answer) in a task, a loss either way.
OLD_FILE_NAMES: Dict[str, bool] = {"loss": False}


def row(name: str) -> Optional[Row]:
    """The table's row of a name (``logit-diff:3,7@-2`` → the ``logit-diff:C,W`` row); None if not a name."""
    if name.startswith("logit-diff:"):
        return _ROWS["logit-diff:C,W"]
    return _ROWS.get(name)


def names(accept: Sequence[str] = NEEDS, prompts: Sequence[str] = TOKENS) -> Tuple[str, ...]:
    """The names an analysis that evaluates ``accept`` (needs) on ``prompts`` takes: by ``prompts`` (its own
    kind first), then in the table's order."""
    rows = [r for r in TABLE if r.needs in accept and r.prompts in prompts]
    return tuple(r.name for r in sorted(rows, key=lambda r: list(prompts).index(r.prompts)))


def direction_of(name: Optional[str]) -> Optional[bool]:
    """``higher_is_better`` of a name in the table or in an old file (``OLD_FILE_NAMES``); None for any other."""
    if not isinstance(name, str):
        return None
    if name in OLD_FILE_NAMES:
        return OLD_FILE_NAMES[name]
    r = row(name)
    return None if r is None else r.higher_is_better
