"""build/recipe.py, the pieces the three drafter recipes share: the schedule's shape and
the resumable state's round trip (the recipes' own tests run them end to end)."""

import pytest
import torch

from build import recipe


def test_learning_rate_warms_up_over_a_thirtieth_then_follows_a_cosine_to_zero():
    steps, base = 300, 2.0
    lrs = [recipe.cosine_lr(base, s, steps) for s in range(steps)]
    assert lrs[0] == pytest.approx(base / 10)  # warmup of 300 // 30 = 10 steps
    assert lrs[9] == pytest.approx(base, rel=0.01)  # warmed up, the cosine barely begun
    assert lrs[150] == pytest.approx(base / 2)  # half way down the cosine
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[-1] < base * 1e-3


def test_a_saved_state_resumes_and_another_recipe_is_refused(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    recipe.optimizer_step(model, opt, model(torch.ones(1, 3)).sum())
    path = tmp_path / "state.pt"
    recipe.save_state(path, model, opt, 7, [1.5], {"lr": 1e-3}, evaluations=[{"step": 7}])
    assert not path.with_suffix(".tmp").exists()
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    step, history, extras = recipe.resume(path, {"lr": 1e-3}, fresh, fresh_opt)
    assert (step, history, extras) == (7, [1.5], {"evaluations": [{"step": 7}]})
    assert torch.equal(fresh.weight, model.weight)
    assert fresh_opt.state_dict()["state"][0]["step"] == 1
    with pytest.raises(ValueError, match=r"another recipe \(it differs in lr\)"):
        recipe.resume(path, {"lr": 1.0}, fresh, fresh_opt)
    assert recipe.resume(tmp_path / "none.pt", {}, fresh, fresh_opt) == (0, [], {})
