"""Token choice and verification, shared by every drafting style.

Greedy: drafts are accepted while they equal the target's argmax. Sampling: standard
speculative (rejection) sampling -- accept draft d with probability min(1, p(d)/q(d)),
else draw from normalise(max(p - q, 0)) -- which leaves the committed tokens
distributed exactly as the target's own sampler (temperature / top-p) would. Drafts
chosen without sampling (n-gram lookup) have a one-hot q: accept d with probability
p(d), else draw from p with d removed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from contextlib import contextmanager

import numpy as np
import torch


@contextmanager
def one_torch_thread():
    """Run the enclosed torch ops on the calling thread alone. The sampler's tensors are
    small ([k+1, 49,152] at most): on 2 cores torch's OpenMP pool gains nothing on them,
    and its workers then spin on the cores the next ONNX Runtime step needs. Measured on
    the default engine at 512 tokens: a float64 softmax over [4, 49,152] on 2 threads, then
    a 1-token decode step 27.1 ms; the same softmax on 1 thread, then the step 22.6 ms
    (none: 22.5 ms), the softmax itself 0.6-0.7 ms either way (medians of 20, interleaved).
    Thread counts are per calling thread, so a decoding thread does not change another's."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def on_one_torch_thread(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with one_torch_thread():
            return fn(*args, **kwargs)
    return wrapper


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass(frozen=True)
class DraftVocab:
    """The columns of a drafter's logits when it drafts over a draft vocabulary (EAGLE-3's
    d2t idea): column j is target token ids[j] of the target's `size`. The drafter leaves
    its logits compact and the sampler maps the drafts it picks, so no step scatters
    8,192 columns into 49,152 (a graph's gather, then an argmax and a softmax over the
    wide rows: 1.2-1.5 ms of a DFlash step on the default engine, measured; CHANGELOG.md).
    Tokens outside it have draft probability 0, which verification reads from the
    expanded q: lossless."""
    ids: torch.Tensor  # [columns], int64 target ids, distinct
    size: int  # the target's vocabulary

    @on_one_torch_thread
    def expand(self, probs: torch.Tensor) -> torch.Tensor:
        """Distributions over the columns -> over the target's vocabulary (0 elsewhere)."""
        full = probs.new_zeros(probs.shape[:-1] + (self.size,))
        full[..., self.ids] = probs
        return full


def greedy_choice(logits: torch.Tensor) -> np.ndarray:
    """argmax over the last dim, computed by numpy (single-threaded; ties go to the first
    maximum, as torch's do). A torch reduction this size runs on torch's OpenMP threads,
    which then spin on the cores the next ONNX Runtime step needs: on the default engine
    a 1-token decode step at 512 tokens took 25.8-26.4 ms right after a torch argmax(-1)
    or softmax over a [4-7, 8k-49k] array, 20.4-21.4 ms right after none or numpy's (2
    cores, medians of 20 interleaved)."""
    if logits.dtype in (torch.float32, torch.float64):
        return logits.detach().numpy().argmax(-1)
    return logits.argmax(-1).numpy()


@on_one_torch_thread
def log_softmax(logits: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """torch.log_softmax on one thread (EAGLE-3's tree scores its levels with it)."""
    return torch.log_softmax(logits, dim)


@on_one_torch_thread
def rejection_sample(drafts: torch.Tensor, p: torch.Tensor, q: torch.Tensor,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative (rejection) sampling of a batch of draft rows at once, as vLLM's
    rejection sampler does it: the one verifier every sampling loop runs (Sampler.verify
    hands it a batch of one), so a test can push 100,000 rows through it in one call.

    drafts [B, k] (target token ids); p [B, k + 1, V]: the target's sampling distribution
    after the bonus token and after each draft; q [B, k, V]: the distributions the drafts
    were drawn from (one-hot for drafts chosen without sampling). Draft i is accepted with
    probability min(1, p(d)/q(d)) while all before it were; at the first rejection the
    next token is drawn from normalise(max(p - q, 0)) (p itself where that is all zero),
    after k acceptances from p[k]. Returns (accepted [B], next [B])."""
    batch, k = drafts.shape
    u = torch.rand(batch, k, generator=generator, dtype=torch.float64, device=p.device)
    at = drafts.unsqueeze(-1)
    keep = u * q.gather(-1, at).squeeze(-1) < p[:, :k].gather(-1, at).squeeze(-1)
    accepted = keep.long().cumprod(-1).sum(-1)  # drafts before the first rejection
    rows = torch.arange(batch, device=p.device)
    p_next = p[rows, accepted]
    if k:  # q at the rejected position; none (zero) where every draft was accepted
        q_next = q[rows, accepted.clamp(max=k - 1)] * (accepted < k).unsqueeze(-1)
        residual = (p_next - q_next).clamp(min=0)
    else:
        residual = p_next
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp(min=1e-300), p_next)
    return accepted, torch.multinomial(residual, 1, generator=generator).squeeze(-1)


def target_ids(columns: torch.Tensor, vocab: DraftVocab | None) -> torch.Tensor:
    """Columns of a drafter's logits -> the target token ids they stand for."""
    return columns if vocab is None else vocab.ids[columns]


class Sampler:
    def __init__(self, sampling: Sampling = Sampling()):
        self.sampling = sampling
        self.generator = torch.Generator()
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed)
        else:
            self.generator.seed()

    @on_one_torch_thread
    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The sampling distribution (temperature, then top-p) over the last dim, float64."""
        probs = torch.softmax(logits.double() / self.sampling.temperature, dim=-1)
        if self.sampling.top_p < 1.0:
            ordered, order = probs.sort(dim=-1, descending=True)
            keep = ordered.cumsum(-1) - ordered < self.sampling.top_p  # always keeps the top one
            probs = torch.zeros_like(probs).scatter(-1, order, ordered * keep)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def _draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def pick(self, logits: torch.Tensor) -> int:
        """One token from logits [vocab]."""
        if self.sampling.greedy:
            return int(greedy_choice(logits))
        return self._draw(self.probs(logits))

    @on_one_torch_thread
    def propose(self, draft_logits: torch.Tensor, vocab: DraftVocab | None = None):
        """Draft tokens from drafter logits [k, columns]: (target token ids, their
        distributions over the target's vocabulary, or None when greedy). vocab: what the
        columns are (None: the target's vocabulary itself)."""
        if self.sampling.greedy:
            return target_ids(torch.from_numpy(greedy_choice(draft_logits)), vocab).tolist(), None
        q = self.probs(draft_logits)
        columns = torch.tensor([self._draw(row) for row in q], dtype=torch.long, device=q.device)
        return target_ids(columns, vocab).tolist(), q if vocab is None else vocab.expand(q)

    @on_one_torch_thread
    def confidence(self, draft_logits: torch.Tensor, draft_probs) -> list[float]:
        """Per draft position, the largest probability of the distribution its draft comes
        from (sampling: q; greedy: the drafter's softmax). A function of the drafter's
        distributions alone, never of the drafts drawn from them: choosing how many drafts
        to verify from a drawn draft's own probability would bias which drafts reach
        verification, and rejection sampling would no longer reproduce the target's law
        (tests/test_speculative.py catches exactly that)."""
        if draft_probs is not None:
            return draft_probs.max(-1).values.tolist()
        # greedy: the softmax's largest value is 1 / sum(exp(x - max x)), in numpy for the
        # reason greedy_choice gives
        x = draft_logits.detach().double().numpy()
        return (1.0 / np.exp(x - x.max(-1, keepdims=True)).sum(-1)).tolist()

    @on_one_torch_thread
    def verify(self, drafts: list[int], target_logits: torch.Tensor, draft_probs):
        """Target logits [len(drafts) + 1, vocab] for [bonus, *drafts] -> (accepted, next).

        `accepted` drafts are kept; `next` is the target's token after them.
        """
        k = len(drafts)
        if self.sampling.greedy:
            posterior = greedy_choice(target_logits).tolist()
            accepted = 0
            while accepted < k and drafts[accepted] == posterior[accepted]:
                accepted += 1
            return accepted, posterior[accepted]
        p = self.probs(target_logits[:k + 1])
        drafts_ = torch.tensor([drafts], dtype=torch.long, device=p.device)
        q = draft_probs[None, :k] if k else p.new_zeros(1, 0, p.shape[-1])  # no drafts: no q
        accepted, following = rejection_sample(drafts_, p[None], q, self.generator)
        return int(accepted[0]), int(following[0])

    def verify_deterministic(self, drafts: list[int], target_logits: torch.Tensor):
        """verify() for drafts proposed without a distribution (n-gram lookup).

        Their q is one-hot on the draft, so the rule above becomes: accept d with
        probability p(d), else draw from p with d removed and renormalised.
        """
        if self.sampling.greedy:
            return self.verify(drafts, target_logits, None)
        ids = torch.tensor(drafts, dtype=torch.long, device=target_logits.device)
        one_hot = torch.nn.functional.one_hot(ids, target_logits.shape[-1])
        return self.verify(drafts, target_logits, one_hot.double())
