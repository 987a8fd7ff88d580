"""The jaxtyping shape annotations of the core functions are checked at run time here (beartype)."""

import pytest
import torch
from beartype import beartype
from jaxtyping import TypeCheckError, jaxtyped

from qkcircuits._foundation.capture import expand_kv
from qkcircuits._analysis.detect import mask_score, target_masks


def checked(fn):
    return jaxtyped(typechecker=beartype)(fn)


def test_annotations_accept_the_documented_shapes():
    toks = torch.tensor([[0, 5, 6, 7, 5, 6, 7]])
    masks = checked(target_masks)(toks, 3)
    pattern = torch.rand(1, 4, 7, 7).softmax(-1)
    assert checked(mask_score)(pattern, masks["induction"]).shape == (4,)
    assert checked(expand_kv)(torch.rand(2, 7, 3, 8), 9).shape == (2, 7, 9, 8)


def test_annotations_reject_mismatched_shapes():
    masks = target_masks(torch.tensor([[0, 5, 6, 7, 5, 6, 7]]), 3)
    with pytest.raises(TypeCheckError):                       # pattern's q/k disagree with the mask's
        checked(mask_score)(torch.rand(1, 4, 6, 6), masks["induction"])
    with pytest.raises(TypeCheckError):                       # pattern with no head axis
        checked(mask_score)(torch.rand(1, 7, 7), masks["induction"])
    with pytest.raises(TypeCheckError):                       # tokens must be [batch, pos]
        checked(target_masks)(torch.tensor([0, 5, 6, 5, 6]), 2)


def test_the_import_hook_checks_every_package_function_unasked():
    # tests/conftest.py installs jaxtyping's import hook with beartype: no explicit `checked` needed here
    import qkcircuits as qk

    masks = target_masks(torch.tensor([[0, 5, 6, 7, 5, 6, 7]]), 3)
    with pytest.raises(TypeCheckError):                       # a tensor shape
        mask_score(torch.rand(1, 4, 6, 6), masks["induction"])
    with pytest.raises(TypeCheckError):                       # a plain type
        qk.parse_heads(5)
