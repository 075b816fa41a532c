"""Single-sequence and batched decoding on bare backend roles (a target and a drafter
object, no engine directory): the one loop of runtime/decode.py, set up for each drafting
style. Tests and tools that hold a model in hand use these; an Engine builds the same
decoders from a mode (Engine.decoder)."""

from __future__ import annotations

from runtime.backends import Target
from runtime.backends.rows import RowBlockDrafters, RowTargets
from runtime.decode import Decoder, OnTokens, Request, policy_for
from runtime.metrics import Generation
from runtime.ngram import NGramProposer
from runtime.proposers import Block, Chain, Lookup, NoDrafts, Tree
from runtime.sampling import Sampler
from runtime.step_costs import StepCosts
from runtime.tree import TreeShape


def decode_one(target: Target, proposer, prompt: list[int], max_new_tokens: int,
               sampler: Sampler, stop_ids=frozenset(), on_tokens: OnTokens = None,
               costs: StepCosts | None = None) -> Generation:
    """One sequence on `target` (a batch of one)."""
    decoder = Decoder(RowTargets(lambda: target, target.context_limit), proposer, policy_for(costs))
    return decoder.generate(Request(prompt, max_new_tokens, stop_ids=stop_ids,
                                    on_tokens=on_tokens, sampler=sampler))


def generate_target_only(target, prompt, max_new_tokens, sampler, stop_ids=frozenset(),
                         on_tokens=None) -> Generation:
    return decode_one(target, NoDrafts(), prompt, max_new_tokens, sampler, stop_ids, on_tokens)


def generate_block(target, drafter, prompt, max_new_tokens, sampler, stop_ids=frozenset(),
                   on_tokens=None, costs=None, proposer: NGramProposer | None = None) -> Generation:
    """DFlash blocks; with `proposer`, assisted by n-gram lookup (hybrid)."""
    block = Block(RowBlockDrafters(lambda: drafter), (lambda: proposer) if proposer else None)
    return decode_one(target, block, prompt, max_new_tokens, sampler, stop_ids, on_tokens, costs)


def generate_chain(target, drafter, prompt, max_new_tokens, sampler, stop_ids=frozenset(),
                   on_tokens=None, costs=None) -> Generation:
    return decode_one(target, Chain(lambda: drafter), prompt, max_new_tokens, sampler, stop_ids,
                      on_tokens, costs)


def generate_tree(target, drafter, prompt, max_new_tokens, sampler, shape: TreeShape = TreeShape(),
                  stop_ids=frozenset(), on_tokens=None) -> Generation:
    return decode_one(target, Tree(lambda: drafter, shape), prompt, max_new_tokens, sampler,
                      stop_ids, on_tokens)


def generate_ngram(target, proposer: NGramProposer, prompt, max_new_tokens, sampler,
                   stop_ids=frozenset(), on_tokens=None) -> Generation:
    return decode_one(target, Lookup(lambda: proposer), prompt, max_new_tokens, sampler,
                      stop_ids, on_tokens)


def batch_decoder(target, drafter=None, costs: StepCosts | None = None) -> Decoder:
    """Target-only (no drafter) or DFlash blocks over batched roles (BatchTarget,
    BatchBlockDrafter); requests join with add() and step together."""
    proposer = Block(drafter) if drafter is not None else NoDrafts()
    slack = drafter.block_size if drafter is not None else 1
    return Decoder(target, proposer, policy_for(costs if drafter is not None else None), slack)


def generate_batch(target, drafter, requests: list[Request], costs: StepCosts | None = None,
                   max_batch: int | None = None, join_at: list[int] | None = None):
    return batch_decoder(target, drafter, costs).run(requests, max_batch, join_at)
