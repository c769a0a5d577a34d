"""train/release.check_state: the tensors a release or checkpoint gives against the model's."""

from __future__ import annotations

import pytest
import torch

from train.release import ReleaseError, check_state


def test_check_state_names_the_first_tensor_that_differs_or_holds_nan():
    reference = {"w": torch.empty(2, 3, device="meta"), "b": torch.empty(3, device="meta")}
    check_state({"w": torch.zeros(2, 3), "b": torch.zeros(3)}, reference, "rel")
    with pytest.raises(ReleaseError, match=r"rel: tensor 'b' has shape \[4\]"):
        check_state({"w": torch.zeros(2, 3), "b": torch.zeros(4)}, reference, "rel")
    with pytest.raises(ReleaseError, match="rel: tensor 'b' is missing"):
        check_state({"w": torch.zeros(2, 3)}, reference, "rel")
    with pytest.raises(ReleaseError, match="rel: tensor 'w' holds NaN or Inf"):
        check_state(
            {"w": torch.tensor([[0.0, float("inf"), 0.0]] * 2), "b": torch.zeros(3)},
            reference,
            "rel",
        )
    check_state({"w": torch.empty(2, 3, device="meta"), "b": torch.zeros(3)}, reference, "rel")
