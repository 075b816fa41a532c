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


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One verify step of one sequence, as recorded: its context length, the drafts it
    verified, how many were accepted (the target's own token not counted), and where the
    drafter ran, the visible keys and beta of its first query row."""
    context: int
    drafts: int
    accepted: int
    visible: int | None
    beta: float | None


# Context-length buckets of the serving metrics: (upper bound exclusive, label).
CONTEXT_BUCKETS = ((2048, "<2K"), (8192, "2K-8K"), (32768, "8K-32K"), (None, ">=32K"))


def context_bucket(tokens: int) -> str:
    return next(label for bound, label in CONTEXT_BUCKETS if bound is None or tokens < bound)


@dataclasses.dataclass
class SpeculationTotals:
    """What one mode's steps in one context-length bucket add to the serving counters."""
    steps: int = 0
    drafting_steps: int = 0  # steps that verified at least one draft (vLLM's "drafts")
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: Counter = dataclasses.field(default_factory=Counter)  # 1-based
    drafter_sitouts: int = 0
    betas: list[float] = dataclasses.field(default_factory=list)


def speculation_totals(gen: "Generation", uses_drafter: bool) -> dict[str, SpeculationTotals]:
    """A finished generation's steps, per context-length bucket. A drafter sit-out is a
    step of a mode with a drafter model on which that drafter did not run (the policy sat
    it out, or an n-gram lookup's drafts were verified instead)."""
    out: dict[str, SpeculationTotals] = {}
    for step in gen.steps():
        t = out.setdefault(context_bucket(step.context), SpeculationTotals())
        t.steps += 1
        t.drafting_steps += step.drafts > 0
        t.draft_tokens += step.drafts
        t.accepted_tokens += step.accepted
        for position in range(1, step.accepted + 1):
            t.accepted_per_position[position] += 1
        if step.beta is None:
            t.drafter_sitouts += uses_drafter
        else:
            t.betas.append(step.beta)
    return out


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
    context_per_step: list[int] = dataclasses.field(default_factory=list)  # tokens in the
    # sequence (prompt + committed) when each verify step ran: its context-length bucket
    # (token, its log-probability, [(id, log-probability)] of the likeliest) per committed
    # token, from the target's logits there, when the request asked (decode.Request.logprobs)
    logprobs: list[tuple] = dataclasses.field(default_factory=list)
    visible_marks: list[int] = dataclasses.field(default_factory=list)  # len(visible_per_step)
    # when each step was recorded: the loop records a step's visible keys and beta right
    # after the step itself, and only when the drafter ran, so step i drafted iff the
    # next mark (or the final length) is past marks[i]

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
        self.context_per_step.append(self.prompt_tokens + len(self.tokens))
        self.visible_marks.append(len(self.visible_per_step))
        self.verified_per_step.append(verified)
        self.committed_per_step.append(committed)

    def steps(self) -> list[StepRecord]:
        """Each verify step as the loop recorded it, with the drafter's visible keys and
        beta where the drafter ran that step (None where it sat out or there is none)."""
        marks = self.visible_marks + [len(self.visible_per_step)]
        return [StepRecord(context, verified, committed - 1,
                           self.visible_per_step[marks[i]] if marks[i + 1] > marks[i] else None,
                           self.beta_per_step[marks[i]] if marks[i + 1] > marks[i] else None)
                for i, (context, verified, committed) in enumerate(
                    zip(self.context_per_step, self.verified_per_step, self.committed_per_step))]

    def speculation(self, mode) -> dict:
        """The per-request `sharpdraft` object a served response carries beside `usage`:
        the mode that ran, MAL, the drafts verified and accepted at each step, the mean beta over the
        drafter's steps (1.0 where it never ran: nothing was scaled) and the visible keys
        of its last step."""
        steps = self.steps()
        betas = [s.beta for s in steps if s.beta is not None]
        visible = [s.visible for s in steps if s.visible is not None]
        return {"mode": str(mode), "mean_accepted_length": round(self.mean_accepted_length, 6),
                "verify_steps": self.verify_steps,
                "draft_tokens": sum(s.drafts for s in steps),
                "accepted_per_step": [s.accepted for s in steps],
                "drafts_per_step": [s.drafts for s in steps],
                "drafter_steps": len(betas),
                "mean_beta": round(statistics.fmean(betas), 6) if betas else 1.0,
                "visible_keys": visible[-1] if visible else None}

    @property
    def verify_steps(self) -> int:
        return len(self.committed_per_step)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target verify pass (accepted drafts + the target's own)."""
        return statistics.fmean(self.committed_per_step) if self.committed_per_step else 0.0

    @property
    def drafted_steps(self) -> int:
        """Verify passes that checked drafts (the others were plain decode steps: nobody
        drafted, or the policy sat the drafter out)."""
        return sum(1 for v in self.verified_per_step if v)

    @property
    def drafted_mean_accepted_length(self) -> float:
        """Tokens committed per verify pass that checked drafts (vLLM's acceptance length):
        what the drafter buys where it runs, which carries over to another machine; the
        policy's sit-outs (where this machine's step costs say it loses) are left out."""
        drafted = [c for v, c in zip(self.verified_per_step, self.committed_per_step) if v]
        return statistics.fmean(drafted) if drafted else 1.0

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


SPEC_COUNTERS = ("requests", "steps", "drafting_steps", "draft_tokens", "accepted_tokens",
                 "drafter_sitouts")


def read_speculation(text: str) -> dict[tuple[str, str, str], dict]:
    """The sharpdraft_spec_* families of a Prometheus text scrape, summed over instances:
    (model, mode, context bucket) -> counters, accepted per position, the beta
    histogram's count and sum, and MAL recomputed from the counters."""
    out: dict[tuple[str, str, str], dict] = {}
    for name, labels, value in _samples(text, "sharpdraft_spec_"):
        key = (labels.get("model", ""), labels.get("mode", ""), labels.get("context", ""))
        entry = out.setdefault(key, {c: 0.0 for c in SPEC_COUNTERS}
                               | {"accepted_per_position": {}, "beta_count": 0.0, "beta_sum": 0.0})
        family = name[len("sharpdraft_spec_"):]
        if family == "accepted_tokens_per_position_total":
            position = int(labels["position"])
            entry["accepted_per_position"][position] = entry["accepted_per_position"].get(position, 0) + value
        elif family.endswith("_total") and family[:-len("_total")] in SPEC_COUNTERS:
            entry[family[:-len("_total")]] += value
        elif family in ("beta_count", "beta_sum"):
            entry[family] += value
    for entry in out.values():
        steps, drafting = entry["steps"], entry["drafting_steps"]
        entry["mean_accepted_length"] = (entry["accepted_tokens"] + steps) / steps if steps else 0.0
        # over the steps that drafted (every accepted token is on one): vLLM's acceptance length
        entry["mean_accepted_length_drafting"] = (entry["accepted_tokens"] + drafting) / drafting if drafting else 0.0
    return out


def read_turns(text: str, model: str | None = None) -> dict[str, dict]:
    """The scheduler's turns from a Prometheus text scrape (sharpdraft_turn_seconds and
    sharpdraft_turn_longest_seconds, runtime/serve/model.py), of `model` or every model:
    kind -> count and seconds summed over instances, the longest over them."""
    out: dict[str, dict] = {}
    for name, labels, value in _samples(text, "sharpdraft_turn_"):
        if model is not None and labels.get("model") != model:
            continue
        entry = out.setdefault(labels["kind"], {"count": 0, "seconds": 0.0, "longest": 0.0})
        if name == "sharpdraft_turn_seconds_count":
            entry["count"] += int(value)
        elif name == "sharpdraft_turn_seconds_sum":
            entry["seconds"] += value
        elif name == "sharpdraft_turn_longest_seconds":
            entry["longest"] = max(entry["longest"], value)
    return out


def _samples(text: str, prefix: str):
    """(name, labels, value) of each labelled sample of a Prometheus text scrape whose
    name starts with `prefix`."""
    for line in text.splitlines():
        if not line.startswith(prefix) or "{" not in line:
            continue
        name, rest = line.split("{", 1)
        body, value = rest.rsplit("}", 1)
        # label values are ours (model, instance, mode, kind, bucket names): no escaped
        # quotes or commas
        labels = dict(p.split("=", 1) for p in body.split(",") if "=" in p)
        yield name, {k: v.strip('"') for k, v in labels.items()}, float(value.split()[0])


def speculation_delta(before: dict, after: dict) -> dict:
    """What happened between two read_speculation() scrapes, as JSON-ready rows."""
    rows = []
    for key, now in sorted(after.items()):
        then = before.get(key, {})
        row = {"model": key[0], "mode": key[1], "context": key[2]}
        for c in SPEC_COUNTERS + ("beta_count", "beta_sum"):
            row[c] = int(round(now[c] - then.get(c, 0.0))) if c != "beta_sum" else now[c] - then.get(c, 0.0)
        positions = then.get("accepted_per_position", {})
        row["accepted_per_position"] = {str(p): int(round(v - positions.get(p, 0.0)))
                                        for p, v in sorted(now["accepted_per_position"].items())}
        if row["steps"] <= 0:
            continue
        row["mean_accepted_length"] = round((row["accepted_tokens"] + row["steps"]) / row["steps"], 4)
        if row["drafting_steps"] > 0:
            row["mean_accepted_length_drafting"] = round(
                (row["accepted_tokens"] + row["drafting_steps"]) / row["drafting_steps"], 6)
        row["mean_beta"] = round(row.pop("beta_sum") / row["beta_count"], 4) if row["beta_count"] else None
        row.pop("beta_sum", None)
        rows.append(row)
    return {"rows": rows}
