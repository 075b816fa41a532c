"""The paired bootstrap interval the bench reports for SharpDraft's MAL effect."""

import numpy as np

from runtime.metrics import paired_ratio_ci


def test_interval_covers_the_mean_and_is_seeded():
    sharp, frozen = [1.5, 1.2, 1.8, 1.4, 1.6, 1.3, 1.7, 1.5], [1.2, 1.1, 1.3, 1.2, 1.4, 1.2, 1.3, 1.25]
    a, b = paired_ratio_ci(sharp, frozen), paired_ratio_ci(sharp, frozen)
    ratios = np.asarray(sharp) / np.asarray(frozen)
    assert a == b and a["items"] == 8
    assert a["mean"] == round(float(ratios.mean()), 4)
    low, high = a["ci"]
    assert ratios.min() <= low < a["mean"] < high <= ratios.max()
    assert low > 1.0  # every document improves: the interval excludes "no effect"


def test_noise_gives_an_interval_across_one():
    # half the documents gain, half lose by as much: no effect, and the interval says so
    sharp, frozen = [1.2, 1.0, 1.2, 1.0, 1.2, 1.0], [1.0, 1.2, 1.0, 1.2, 1.0, 1.2]
    low, high = paired_ratio_ci(sharp, frozen)["ci"]
    assert low < 1.0 < high


def test_identical_documents_give_a_point():
    result = paired_ratio_ci([1.5] * 4, [1.0] * 4)
    assert result["ci"] == [1.5, 1.5] and result["mean"] == 1.5
