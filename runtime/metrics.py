"""What a generation reports: committed tokens, mean accepted length (MAL), the
acceptance histogram, the drafts each step verified, the visible-key count and beta of
each drafter step, how many steps verified n-gram drafts instead of the drafter's
(n-gram-assisted drafting), and wall time split into prefill / draft / verify / other."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import Counter
from contextlib import contextmanager


@dataclasses.dataclass
class Generation:
    prompt_tokens: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    committed_per_step: list[int] = dataclasses.field(default_factory=list)
    verified_per_step: list[int] = dataclasses.field(default_factory=list)  # drafts checked
    visible_per_step: list[int] = dataclasses.field(default_factory=list)
    beta_per_step: list[float] = dataclasses.field(default_factory=list)
    ngram_steps: int = 0  # block loops: steps that skipped the drafter (verified a
    # lookup's drafts, or, with measured costs, decoded one token where it did not pay)
    seconds: Counter = dataclasses.field(default_factory=Counter)
    stopped_by: str = "length"

    @contextmanager
    def timed(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def step(self, verified: int, committed: int) -> None:
        """One target verify pass: it checked `verified` drafts and committed `committed`
        tokens (the accepted drafts and the target's own)."""
        self.verified_per_step.append(verified)
        self.committed_per_step.append(committed)

    @property
    def verify_steps(self) -> int:
        return len(self.committed_per_step)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target verify pass (accepted drafts + the target's own)."""
        return statistics.fmean(self.committed_per_step) if self.committed_per_step else 0.0

    @property
    def acceptance_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.committed_per_step).items()))

    @property
    def decode_seconds(self) -> float:
        return self.seconds["total"] - self.seconds["prefill"]

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of decoding (prefill excluded, as serving reports it)."""
        return len(self.tokens) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def summary(self) -> dict:
        other = self.seconds["total"] - sum(self.seconds[p] for p in ("prefill", "draft", "verify"))
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": len(self.tokens),
            "verify_steps": self.verify_steps,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "drafts_verified": sum(self.verified_per_step),
            "acceptance_histogram": {str(k): v for k, v in self.acceptance_histogram.items()},
            "tokens_per_second": round(self.tokens_per_second, 3),
            "steps_without_drafter": self.ngram_steps,  # lookup or plain decode steps
            "stopped_by": self.stopped_by,
            "seconds": {p: round(self.seconds[p], 4) for p in ("prefill", "draft", "verify")}
            | {"other": round(max(other, 0.0), 4), "total": round(self.seconds["total"], 4)},
            "visible_keys": {"first": self.visible_per_step[0], "last": self.visible_per_step[-1]}
            if self.visible_per_step else None,
            "beta": {"first": self.beta_per_step[0], "last": self.beta_per_step[-1],
                     "fraction_above_1": sum(b > 1.0 for b in self.beta_per_step)
                     / len(self.beta_per_step)} if self.beta_per_step else None,
        }


def pooled_mean_accepted_length(gens: list[Generation]) -> float:
    """MAL over several generations: all committed tokens / all verify passes."""
    return sum(sum(g.committed_per_step) for g in gens) / sum(g.verify_steps for g in gens)


def pooled_tokens_per_second(gens: list[Generation]) -> float:
    return sum(len(g.tokens) for g in gens) / sum(g.decode_seconds for g in gens)


def paired_ratio_ci(numerators: list[float], denominators: list[float], level: float = 0.95,
                    resamples: int = 10_000, seed: int = 0) -> dict:
    """Mean of the per-item ratios numerator / denominator (e.g. one document's MAL with
    SharpDraft over its MAL frozen, both decoded from the same prefill) and a percentile
    bootstrap interval over the items: resample documents, not steps, so a reader can
    tell an effect from document-to-document noise. Seeded: the same inputs give the
    same interval."""
    import numpy as np

    ratios = np.asarray(numerators, dtype=float) / np.asarray(denominators, dtype=float)
    draws = np.random.default_rng(seed).integers(0, len(ratios), (resamples, len(ratios)))
    means = ratios[draws].mean(axis=1)
    tail = (1 - level) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return {"mean": round(float(ratios.mean()), 4), "ci": [round(float(low), 4), round(float(high), 4)],
            "level": level, "items": len(ratios)}
