"""Token choice and verification, shared by every drafting style.

Greedy: drafts are accepted while they equal the target's argmax. Sampling: standard
speculative (rejection) sampling -- accept draft d with probability min(1, p(d)/q(d)),
else draw from normalise(max(p - q, 0)) -- which leaves the committed tokens
distributed exactly as the target's own sampler (temperature / top-p) would. Drafts
chosen without sampling (n-gram lookup) have a one-hot q: accept d with probability
p(d), else draw from p with d removed.

A request's logits processors (vLLM's: min_tokens, repetition / presence / frequency
penalties, then temperature, min_p, top_k, top_p) shape the target's law itself, so both
p and q go through them, each position with the prefix at that position (the context and
the drafts before it): the committed tokens then follow the processed target law exactly.
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


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """A request's sampling law. Beyond temperature and top_p, vLLM's extensions with its
    meanings: top_k (0: all tokens), min_p (drop tokens below min_p x the likeliest's
    probability), repetition_penalty (a token seen in the prompt or the output has its
    logit divided by it when positive, multiplied when not), presence_penalty and
    frequency_penalty (subtracted once per token seen in the output / per time seen),
    min_tokens (stop tokens are impossible before that many new tokens)."""
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0

    def __post_init__(self):
        if not (_number(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0: every token), got {self.top_k!r}")
        if not (_number(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not (_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (_number(getattr(self, name)) and -2 <= getattr(self, name) <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if not (isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool)
                and self.min_tokens >= 0):
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether a token's logit depends on the tokens before it (the penalties)."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0)

    @property
    def reorders(self) -> bool:
        """Whether processing can change the argmax (so greedy decoding applies it too)."""
        return self.penalised or self.min_tokens > 0

    @property
    def processed(self) -> bool:
        """Whether any processor beyond temperature and top_p is on."""
        return self.reorders or (not self.greedy and (self.top_k > 0 or self.min_p > 0))


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
def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[tuple]:
    """Per row of logits [R, V] (the target's at each committed position): the chosen
    token's log-probability under the target's own distribution (raw logits, as vLLM
    reports them by default) and the `top` likeliest (ids, log-probabilities)."""
    lp = torch.log_softmax(logits.double(), -1)
    chosen = lp.gather(-1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0]
    out = []
    if top:
        values, ids = lp.topk(min(top, lp.shape[-1]), -1)
        tops = list(zip(ids.tolist(), values.tolist()))
    for i, token in enumerate(tokens):
        out.append((token, float(chosen[i]), list(zip(*tops[i])) if top else []))
    return out


def apply_penalties(logits: torch.Tensor, prompt_seen: torch.Tensor, counts: torch.Tensor,
                    sampling: Sampling) -> torch.Tensor:
    """vLLM's penalties on logits [R, V] (float64), each row with its own output counts
    [R, V] and `prompt_seen` [V] (the prompt's tokens): repetition over prompt and output,
    presence and frequency over the output."""
    if sampling.repetition_penalty != 1:
        seen = prompt_seen | (counts > 0)
        scaled = torch.where(logits > 0, logits / sampling.repetition_penalty,
                             logits * sampling.repetition_penalty)
        logits = torch.where(seen, scaled, logits)
    if sampling.frequency_penalty:
        logits = logits - sampling.frequency_penalty * counts
    if sampling.presence_penalty:
        logits = logits - sampling.presence_penalty * (counts > 0)
    return logits


def distribution(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The sampling distribution of processed logits [..., V]: temperature, then min_p,
    top_k and top_p (vLLM's order), float64."""
    probs = torch.softmax(logits.double() / sampling.temperature, dim=-1)
    if sampling.min_p > 0:
        probs = probs * (probs >= sampling.min_p * probs.max(-1, keepdim=True).values)
    if 0 < sampling.top_k < probs.shape[-1]:
        kth = probs.topk(sampling.top_k, -1).values[..., -1:]
        probs = probs * (probs >= kth)  # ties at the k-th value stay (a law, not an order)
    if sampling.min_p > 0 or sampling.top_k > 0:
        probs = probs / probs.sum(-1, keepdim=True)
    if sampling.top_p < 1.0:
        ordered, order = probs.sort(dim=-1, descending=True)
        keep = ordered.cumsum(-1) - ordered < sampling.top_p  # always keeps the top one
        probs = torch.zeros_like(probs).scatter(-1, order, ordered * keep)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


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


def greedy_verify(drafts: np.ndarray, counts: np.ndarray, argmax: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Greedy verification of a batch of draft rows at once, the greedy counterpart of
    rejection_sample (vLLM's rejection sampler checks its greedy requests alike, one
    comparison over the batch): a draft is accepted while it and every draft before it
    equal the target's argmax there.

    drafts [B, K] (target token ids, row i's first counts[i] real, the rest padding);
    counts [B]; argmax [B, T] (T >= K + 1): the target's argmax after the bonus token and
    after each draft (greedy_choice over its logits). Returns (accepted [B], next [B]):
    the drafts kept, and the target's argmax after them. numpy throughout, for the reason
    greedy_choice gives."""
    batch, k = drafts.shape
    real = np.arange(k) < counts[:, None]
    match = (drafts == argmax[:, :k]) & real
    accepted = match.cumprod(-1).sum(-1)  # drafts before the first mismatch
    return accepted, argmax[np.arange(batch), accepted]


def target_ids(columns: torch.Tensor, vocab: DraftVocab | None) -> torch.Tensor:
    """Columns of a drafter's logits -> the target token ids they stand for."""
    return columns if vocab is None else vocab.ids[columns]


class Sampler:
    """One sequence's token choice. bind() gives it the sequence's prompt, its output list
    (read as it grows) and stop ids, which the processors read; unbound, the context is
    empty. Where a method takes rows of logits, row i follows the bound context, then
    `prefix`, then `following[:i]` (the drafts before that position)."""

    def __init__(self, sampling: Sampling = Sampling()):
        self.sampling = sampling
        self.generator = torch.Generator()
        if sampling.seed is not None:
            self.generator.manual_seed(sampling.seed)
        else:
            self.generator.seed()
        self.processing = sampling.processed
        self.bind([], [], frozenset())

    def bind(self, prompt: list[int], output: list[int], stop_ids=frozenset()) -> None:
        self.prompt, self.output, self.stop_ids = prompt, output, stop_ids

    def _process(self, logits: torch.Tensor, following=(), prefix=()) -> torch.Tensor:
        """The penalties and min_tokens on logits [R, V], float64, each row at its own
        position (greedy decoding argmaxes these; sampling takes `distribution`)."""
        s, x = self.sampling, logits.double()
        rows, vocab = x.shape
        before = list(self.output) + list(prefix)
        if s.penalised:
            counts = torch.zeros(rows, vocab, dtype=torch.float64, device=x.device)
            counts[:] = torch.bincount(torch.tensor(before, dtype=torch.long), minlength=vocab)[:vocab]
            for i, token in enumerate(list(following)[:rows - 1]):
                counts[i + 1:, token] += 1
            seen = torch.zeros(vocab, dtype=torch.bool, device=x.device)
            seen[torch.tensor(self.prompt, dtype=torch.long)] = True
            x = apply_penalties(x, seen, counts, s)
        if s.min_tokens and self.stop_ids:
            early = len(before) + torch.arange(rows) < s.min_tokens
            if early.any():
                stops = torch.tensor(sorted(self.stop_ids), dtype=torch.long)
                x = x.clone()
                x[early.nonzero()[:, 0, None], stops[None]] = -math.inf
        return x

    @on_one_torch_thread
    def probs(self, logits: torch.Tensor, following=(), prefix=()) -> torch.Tensor:
        """The sampling distribution over the last dim, float64: the processors, then
        temperature, min_p, top_k, top_p (`distribution`)."""
        if self.sampling.reorders:
            logits = self._process(logits.reshape(-1, logits.shape[-1]), following,
                                   prefix).reshape(logits.shape)
        return distribution(logits, self.sampling)

    def _draw(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def _argmax(self, logits: torch.Tensor, following=(), prefix=()) -> list[int]:
        if self.sampling.reorders:
            logits = self._process(logits, following, prefix)
        return greedy_choice(logits).tolist()

    def pick(self, logits: torch.Tensor) -> int:
        """One token from logits [vocab], after the bound context."""
        if self.sampling.greedy:
            if self.processing:
                return self._argmax(logits[None])[0]
            return int(greedy_choice(logits))
        return self._draw(self.probs(logits))

    @on_one_torch_thread
    def propose(self, draft_logits: torch.Tensor, vocab: DraftVocab | None = None, prefix=()):
        """Draft tokens from drafter logits [k, columns]: (target token ids, their
        distributions over the target's vocabulary, or None when greedy). vocab: what the
        columns are (None: the target's vocabulary itself). With processors, row i is
        processed after the drafts drawn before it (`prefix`: drafts of this chain
        drawn by earlier calls)."""
        if self.sampling.reorders:  # each row after the drafts drawn before it
            if vocab is not None:  # processors read target ids: the rows over the target's vocabulary
                full = draft_logits.new_full(draft_logits.shape[:-1] + (vocab.size,), -math.inf)
                full[..., vocab.ids] = draft_logits
                draft_logits, vocab = full, None
            drafts, rows = [], []
            for row in draft_logits:
                drawn = list(prefix) + drafts
                if self.sampling.greedy:
                    drafts += self._argmax(row[None], prefix=drawn)
                else:
                    rows.append(self.probs(row[None], prefix=drawn)[0])
                    drafts.append(self._draw(rows[-1]))
            if self.sampling.greedy:
                return drafts, None
            return drafts, torch.stack(rows) if rows else draft_logits.new_zeros(draft_logits.shape, dtype=torch.float64)
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

        `accepted` drafts are kept; `next` is the target's token after them. With
        processors, row i is processed after drafts[:i], as the drafts were drawn.
        """
        k = len(drafts)
        if self.sampling.greedy:
            posterior = self._argmax(target_logits[:k + 1], following=drafts)
            accepted = 0
            while accepted < k and drafts[accepted] == posterior[accepted]:
                accepted += 1
            return accepted, posterior[accepted]
        p = self.probs(target_logits[:k + 1], following=drafts)
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
