"""Causal checks say whether the margin over random exceeds the random sets' spread (issue 45 ask 7): the scan's
confirmation sentence, ``RandomComparison`` (the notebook's repr) and the zoo's line all carry the verdict of
``stats.versus_random``, and warn when the margin is within one SD of the random sets.

Ground truth: numbers chosen here (the issue's "+9.207 vs random max +9.026" within a spread of 0.19; a margin of
many SDs), and their SD by hand."""

from __future__ import annotations

import math

import pytest
import torch

from qkcircuits._analysis.ablate import RandomComparison
from qkcircuits._analysis.detect import confirmation_sentence
from qkcircuits._foundation.heads import Head
from qkcircuits._foundation.stats import versus_random
from qkcircuits._scale.zoo import confirmation_verdict

NEAR = [9.026, 8.6, 8.9, 8.7]        # sd 0.1918 (n - 1), mean 8.8065: +9.207 is 0.181 over the max


def test_versus_random_by_hand():
    v = versus_random(9.207, NEAR)
    mean = sum(NEAR) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in NEAR) / 3)
    assert v["sd"] == pytest.approx(sd) and v["z"] == pytest.approx((9.207 - mean) / sd)
    assert v["margin"] == pytest.approx(9.207 - 9.026) and v["clear"] is False
    assert versus_random(12.0, NEAR)["clear"] is True
    assert versus_random(12.0, [1.0])["clear"] is None                     # one set: no spread


def test_every_causal_check_warns_within_the_spread():
    near = confirmation_sentence({"heads": ["1.0"], "effect": 9.207, "random_effects": NEAR})
    assert "WARNING: within the random sets' spread" in near and "(0.192)" in near, near
    assert "above random" in confirmation_sentence({"heads": ["1.0"], "effect": 12.0, "random_effects": NEAR})
    comp = RandomComparison([Head(1, 0)], 0.0, 9.207, torch.tensor(NEAR), [[Head(0, 0)]] * 4, "zero",
                            "induction-loss", 0)
    assert "WARNING: within the random sets' spread" in repr(comp) and "WARNING" in comp._repr_html_()
    v = versus_random(9.207, NEAR)
    entry = {"effect": 9.207, "random_max": 9.026, "random_sd": v["sd"], "z": v["z"], "clear": v["clear"]}
    assert confirmation_verdict(entry).startswith("WARNING: within the random sets' spread (margin +0.181 <= SD 0.192")
    assert confirmation_verdict({"effect": 9.2, "random_max": 9.0}).startswith("no verdict")
    from qkcircuits.cli.zoo_command import format_zoo

    m = {"model": "m", "n_layers": 2, "n_heads": 2, "induction": [], "previous_token": [], "confirmation": entry,
         "strongest": {"induction": {"head": "1.0", "score": 0.1}, "previous_token": {"head": "0.0"}}}
    assert "+9.21 vs random max +9.03: WARNING" in format_zoo([m])
