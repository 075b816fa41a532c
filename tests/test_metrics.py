"""The paired bootstrap interval the bench reports for SharpDraft's MAL effect."""

import numpy as np
import pytest

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


# --- what serving counts per step (runtime/metrics.py: steps, speculation_totals) -----


def test_context_buckets_split_at_2k_8k_32k():
    from runtime.metrics import context_bucket

    assert [context_bucket(n) for n in (1, 2047, 2048, 8191, 8192, 32767, 32768, 10**6)] == \
        ["<2K", "<2K", "2K-8K", "2K-8K", "8K-32K", "8K-32K", ">=32K", ">=32K"]


def test_step_records_line_up_with_the_drafter_steps_of_a_real_decode(tiny_engine):
    """A hybrid decode (the drafter sits out where the lookup matches): each step's
    record carries a beta exactly where the drafter ran, so the steps without one are
    the loop's own count of steps without the drafter, and each step's context is the
    prompt plus what the steps before it committed."""
    from runtime.engine import Engine
    from runtime.spec import open_spec
    from runtime.metrics import speculation_totals

    engine = Engine(open_spec(tiny_engine))
    prompt = engine.encode("def fib(n):\n" * 12 + "def fib(n):")
    gen = engine.generate(prompt, 24, "hybrid")
    steps = gen.steps()
    assert len(steps) == gen.verify_steps and 0 < gen.ngram_steps < gen.verify_steps
    assert sum(s.beta is None for s in steps) == gen.ngram_steps
    assert [s.beta for s in steps if s.beta is not None] == gen.beta_per_step
    assert [s.visible for s in steps if s.visible is not None] == gen.visible_per_step
    committed = [len(prompt) + 1]  # the prefill's token, then each step's
    for c in gen.committed_per_step[:-1]:
        committed.append(committed[-1] + c)
    assert [s.context for s in steps] == committed
    assert sum(s.accepted for s in steps) + len(steps) == sum(gen.committed_per_step)
    totals = speculation_totals(gen, uses_drafter=True)
    assert list(totals) == ["<2K"]
    t = totals["<2K"]
    assert (t.steps, t.drafter_sitouts, t.betas) == (len(steps), gen.ngram_steps, gen.beta_per_step)
    assert sum(t.accepted_per_position.values()) == t.accepted_tokens
    assert speculation_totals(gen, uses_drafter=False)["<2K"].drafter_sitouts == 0


def test_totals_split_a_request_at_the_bucket_it_crosses():
    from runtime.metrics import Generation, speculation_totals

    gen = Generation(prompt_tokens=2040)
    gen.tokens.append(1)  # the prefill's token: the first step runs at 2,041 tokens
    for accepted in (3, 0, 4, 2):  # contexts 2041, 2045, 2046, 2051
        gen.step(verified=5, committed=accepted + 1)
        gen.visible_per_step.append(gen.context_per_step[-1])
        gen.beta_per_step.append(1.25)
        gen.tokens.extend([1] * (accepted + 1))
    totals = speculation_totals(gen, uses_drafter=True)
    assert {k: (t.steps, t.accepted_tokens, t.draft_tokens) for k, t in totals.items()} == \
        {"<2K": (3, 7, 15), "2K-8K": (1, 2, 5)}
    assert dict(totals["<2K"].accepted_per_position) == {1: 2, 2: 2, 3: 2, 4: 1}


def test_a_scrape_sums_instances_and_recomputes_mal():
    from runtime.metrics import read_speculation, speculation_delta

    def scrape(steps, accepted):
        rows = []
        for instance, share in (("m_0", 0.5), ("m_1", 0.5)):
            labels = f'context="<2K",instance="{instance}",mode="sharpdraft",model="m"'
            rows += [f"sharpdraft_spec_steps_total{{{labels}}} {steps * share}",
                     f"sharpdraft_spec_accepted_tokens_total{{{labels}}} {accepted * share}",
                     f'sharpdraft_spec_accepted_tokens_per_position_total{{{labels},position="1"}} {steps * share}',
                     f"sharpdraft_spec_beta_count{{{labels}}} {steps * share}",
                     f"sharpdraft_spec_beta_sum{{{labels}}} {1.5 * steps * share}",
                     f'sharpdraft_spec_beta_bucket{{{labels},le="1.5"}} {steps * share}']
        return "# HELP x\n" + "\n".join(rows) + "\nnv_inference_count{model=\"m\"} 3\n"

    before, after = read_speculation(scrape(4, 6)), read_speculation(scrape(10, 20))
    assert after[("m", "sharpdraft", "<2K")]["steps"] == 10
    assert after[("m", "sharpdraft", "<2K")]["mean_accepted_length"] == 3.0
    row, = speculation_delta(before, after)["rows"]
    assert (row["steps"], row["accepted_tokens"], row["beta_count"]) == (6, 14, 6)
    assert row["mean_beta"] == 1.5 and row["accepted_per_position"] == {"1": 6}


def test_a_turns_scrape_sums_counts_and_keeps_the_longest_per_model():
    from runtime.metrics import read_turns

    rows = []
    for model, instance, count, total, longest in (("m", "m_0", 3, 0.6, 0.3), ("m", "m_1", 2, 0.2, 0.5),
                                                   ("other", "other_0", 9, 9.0, 4.0)):
        labels = f'instance="{instance}",kind="chunk",model="{model}"'
        rows += [f"sharpdraft_turn_seconds_count{{{labels}}} {count}",
                 f"sharpdraft_turn_seconds_sum{{{labels}}} {total}",
                 f'sharpdraft_turn_seconds_bucket{{{labels},le="1"}} {count}',
                 f"sharpdraft_turn_longest_seconds{{{labels}}} {longest}"]
    text = "# HELP x\n" + "\n".join(rows) + "\nsharpdraft_batch_peak_rows{model=\"m\"} 3\n"
    assert read_turns(text, "m") == {"chunk": {"count": 5, "seconds": pytest.approx(0.8), "longest": 0.5}}
    assert read_turns(text)["chunk"]["longest"] == 4.0 and read_turns(text)["chunk"]["count"] == 14
