import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from tiers import examples

from plugins.scaling import QueryScaling, beta, log_odds_decomposition, top_k_mass
from runtime.families import FAMILIES

PRESETS = {name: f.preset for name, f in FAMILIES.items() if f.preset}  # the families' presets


def test_beta_is_exactly_one_up_to_the_reference_count():
    assert all(beta(n) == 1.0 for n in range(0, 2049))


def test_beta_matches_seed_worked_example():
    assert beta(16_416) == pytest.approx(1.419, abs=1e-3)
    r = (16_416 - 32) / (2048 - 32)
    assert r == pytest.approx(8.127, abs=1e-3)
    # With contrast fixed, 50% at 2,048 keys falls to 1 / (1 + r) at 16,416 keys.
    assert 1 / (1 + r) == pytest.approx(0.1096, abs=1e-4)


def test_cap_first_reached_near_51694_keys():
    s = QueryScaling()
    assert s.cap == pytest.approx(math.exp(0.5))
    assert s.cap_keys == pytest.approx(51_694, abs=1)
    assert beta(51_693) < s.cap
    assert beta(51_695) == s.cap
    assert beta(10**9) == s.cap


@given(st.integers(0, 200_000), st.integers(0, 200_000))
def test_beta_is_non_decreasing(a, b):
    lo, hi = sorted((a, b))
    assert beta(lo) <= beta(hi)


@given(st.lists(st.integers(0, 120_000), min_size=1, max_size=50),
       st.sampled_from(list(PRESETS.values())))
def test_torch_and_python_paths_agree(ns, scaling):
    got = scaling.beta(torch.tensor(ns, dtype=torch.float64))
    want = torch.tensor([scaling.beta(n) for n in ns], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    got32 = scaling.beta(torch.tensor(ns))  # int64 in, float32 out
    assert got32.dtype == torch.float32
    assert torch.allclose(got32.double(), want, atol=1e-6)


@given(st.integers(0, 200_000), st.sampled_from(list(PRESETS.values())))
def test_kernel_constants_restate_the_same_rule(n, scaling):
    top_k, inv_slope, bias, cap = scaling.kernel_constants()
    kernel_form = min(cap, max(1.0, math.log(max(n - top_k, 1)) * inv_slope + bias))
    assert kernel_form == pytest.approx(scaling.beta(n), abs=1e-12)


def test_presets():
    assert PRESETS["dflash"] == QueryScaling(2048, 32, 5.0, 0.5)
    assert PRESETS["pard"].ref_keys == 8192


@pytest.mark.parametrize("kwargs, name", [
    ({"ref_keys": 32}, "ref_keys"), ({"ref_keys": 16}, "ref_keys"), ({"slope": 0}, "slope"),
    ({"slope": -1.0}, "slope"), ({"max_log_scale": -0.1}, "max_log_scale"),
    ({"slope": float("nan")}, "slope"), ({"top_k": 0}, "top_k"), ({"ref_keys": 100.5}, "ref_keys"),
])
def test_invalid_parameters_raise_naming_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        QueryScaling(**kwargs)
    with pytest.raises(ValueError, match=name):
        beta(4096, **kwargs)


@pytest.mark.parametrize("n", [-1, float("nan"), "12"])
def test_invalid_key_counts_raise(n):
    with pytest.raises(ValueError, match="visible keys"):
        beta(n)


def test_invalid_key_count_tensors_raise():
    with pytest.raises(ValueError, match="visible keys"):
        beta(torch.tensor([5.0, -3.0]))
    with pytest.raises(ValueError, match="visible keys"):
        beta(torch.tensor([float("nan")]))


def test_from_dict_round_trip_and_unknown_fields():
    s = QueryScaling(4096, 16, 4.0, 0.25)
    assert QueryScaling.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="unknown query scaling field"):
        QueryScaling.from_dict({"ref_keys": 4096, "temperature": 2})


def test_describe_names_all_four_parameters_and_the_cap():
    s = QueryScaling(ref_keys=1024, top_k=32, slope=2.5, max_log_scale=0.75)
    assert s.describe() == "ref_keys=1024 top_k=32 slope=2.5 max_log_scale=0.75 (cap 2.117)"
    assert "slope=5 max_log_scale=0.5 (cap 1.649)" in QueryScaling().describe()


@settings(max_examples=examples(40))
@given(st.integers(0, 2**31 - 1), st.integers(33, 5000), st.floats(0.1, 4.0))
def test_log_odds_decomposition_is_exact(seed, n, spread):
    scores = spread * torch.randn(3, n, generator=torch.Generator().manual_seed(seed),
                                  dtype=torch.float64)
    log_odds, contrast, competitor = log_odds_decomposition(scores, k=32)
    assert torch.allclose(log_odds, contrast - competitor, atol=1e-6, rtol=0)
    mass = top_k_mass(torch.softmax(scores, -1), 32)
    assert torch.allclose(torch.log(mass / (1 - mass)), log_odds, atol=1e-6)


def test_sharpening_raises_top_k_mass_and_dilution_lowers_it():
    g = torch.Generator().manual_seed(0)
    short = torch.randn(2048, generator=g, dtype=torch.float64) * 2
    long = torch.cat([short, torch.randn(14_368, generator=g, dtype=torch.float64) * 2])
    m_short = top_k_mass(torch.softmax(short, -1))
    m_long = top_k_mass(torch.softmax(long, -1))
    m_sharp = top_k_mass(torch.softmax(long * beta(long.numel()), -1))
    assert m_long < m_short and m_sharp > m_long
