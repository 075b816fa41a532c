"""The decoding loops: target-only, DFlash-style block speculation, chain speculation
(PARD; EAGLE-3 with top_k = 1), EAGLE-3 tree speculation, n-gram lookup.

Block speculation, one step: the drafter sees the target features of the tokens
committed since its last step and drafts a block [bonus, d1 .. d(k)] in one pass; the
target verifies the block in one pass; the longest agreeing prefix is kept plus the
target's own next token; the target cache rolls back to the committed length and the
verified features of the kept tokens become the drafter's new context. With measured
step costs, a step verifies only the first k drafts, k chosen from the drafter's own
confidence, scaled by how often its drafts were accepted so far in this generation
(runtime/step_costs.py: choose_draft_count, AcceptanceRecord), which keeps it lossless.
N-gram-assisted (hybrid): a step whose context ends in a 2+-token n-gram seen before
verifies the lookup's drafts instead (one-hot, as n-gram speculation does) and skips the
drafter; the drafter's next step reads the verified features of every token committed
since its last one, so its cache stays exact. With measured step costs, a step without
such a match runs the drafter only when it beats a plain decode step, else it verifies a
1-token match's drafts or decodes one token, as n-gram speculation does; and lookups
verify only the drafts their record says land (runtime/step_costs.py: HybridChoice).
Without a proposer the same rule makes a step whose drafter does not pay a plain decode
step (the drafter reads the skipped tokens' features next time). These choices read the
context and past steps' outcomes, never the target's verdict on the step itself, so
decoding stays lossless.

Chain speculation, one step: the drafter reads the tokens committed since its last step
(and, if it wants them, the target's features of the tokens before them) and proposes k
drafts d1 .. dk, each row causal over the drafter's own cache; the target verifies
[last committed token, d1 .. dk] in one pass, exactly as for a block; the accepted
drafts and the target's own next token are what the drafter reads next. Adaptive draft
length works as for blocks (the drafter's confidence per position, never a drawn draft's
own probability).

Tree speculation (EAGLE-3's dynamic tree), one step: the drafter ingests the target
features of the tokens committed since its last step and grows a tree of drafts below
the last committed token (runtime/tree.py); the target verifies every node in one pass
under the tree's mask; the longest path whose tokens are the target's own argmax is
kept, plus the target's next token; both caches keep only that path (the target's by
compacting its scratch keys, the drafter's by ingesting the path's features next step).

N-gram speculation, one step: the proposer looks the context's last tokens up in the
context itself and proposes what followed them (or nothing); the target verifies
[last committed token, *drafts] in one pass, exactly as for a block.
"""

from __future__ import annotations

from typing import Callable

import torch

from runtime.backends import BlockDrafter, ChainDrafter, Target, TreeDrafter
from runtime.metrics import Generation
from runtime.ngram import NGramProposer
from runtime.sampling import Sampler, greedy_choice
from runtime.step_costs import AcceptanceRecord, HybridChoice, StepCosts, choose_draft_count
from runtime.tree import DraftTree, TreeShape

OnTokens = Callable[[list[int]], None]


def _budget(target: Target, prompt: list[int], max_new_tokens: int) -> int:
    if not prompt:
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    room = target.context_limit - len(prompt)
    if room < 1:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the target's context holds "
                         f"{target.context_limit}")
    return min(max_new_tokens, room)


def _commit(gen: Generation, new: list[int], stop_ids: frozenset[int], on_tokens) -> bool:
    """Append committed tokens, cutting at a stop token; True when generation must end."""
    for i, token in enumerate(new):
        if token in stop_ids:
            new = new[: i + 1]
            gen.stopped_by = "stop_token"
            break
    gen.tokens.extend(new)
    if on_tokens:
        on_tokens(new)
    return gen.stopped_by == "stop_token"


def generate_target_only(target: Target, prompt: list[int], max_new_tokens: int,
                         sampler: Sampler, stop_ids=frozenset(), on_tokens: OnTokens = None
                         ) -> Generation:
    budget = _budget(target, prompt, max_new_tokens)
    gen = Generation(len(prompt))
    with gen.timed("total"):
        with gen.timed("prefill"):
            logits, _ = target.prefill(prompt, len(prompt) + budget)
        done = _commit(gen, [sampler.pick(logits)], stop_ids, on_tokens)
        while not done and len(gen.tokens) < budget:
            with gen.timed("verify"):
                logits, _ = target.verify(gen.tokens[-1:])
            gen.step(verified=0, committed=1)
            done = _commit(gen, [sampler.pick(logits[-1])], stop_ids, on_tokens)
    return gen


# Hybrid steps verify the lookup's drafts only when they follow a match of 2+ tokens: a
# 1-token match is a weak guess, and there the drafter does better. Measured on the
# default engine (one document, 64 new tokens, 512 / 4,096 tokens of context, one shared
# 2-core machine): lookup on any match, MAL 1.80 / 1.91 (n-gram alone 1.80 / 1.85); on 2+
# token matches, 2.25 / 1.97 and the fastest of the three. Running the drafter every step
# to weigh its confidence against the lookup cost more than it bought (its step was a
# third of a verify pass there), so the choice reads the lookup alone. Without such a
# match and with measured costs, the drafter runs only where it pays (HybridChoice).
LOOKUP_MIN_MATCH = 2


def _drafter_prefill(drafter: BlockDrafter, context: torch.Tensor, token: int) -> None:
    """Store the drafter's cache entries for the prompt's features, as serving engines
    run the draft model's prefill with the target's: otherwise the first decode step pays
    for the whole prompt (~0.5 s at 7,680 tokens on one core, a tenth of a 64-token
    decode). A DFlash context row's entry depends on its own features and position
    alone, so storing them in two calls stores the same cache; the block drafted here
    with `token` is scratch the next step overwrites."""
    drafter.draft(context, token)


def generate_block(target: Target, drafter: BlockDrafter, prompt: list[int],
                   max_new_tokens: int, sampler: Sampler, stop_ids=frozenset(),
                   on_tokens: OnTokens = None, costs: StepCosts | None = None,
                   proposer: NGramProposer | None = None) -> Generation:
    budget = _budget(target, prompt, max_new_tokens)
    gen = Generation(len(prompt))
    with gen.timed("total"):
        with gen.timed("prefill"):
            logits, context = target.prefill(prompt, len(prompt) + budget)
            drafter.reset(len(prompt) + budget)
            if len(context) > 1:  # the drafter's own prefill: see _drafter_prefill
                _drafter_prefill(drafter, context[:-1], prompt[-1])
                context = context[-1:]
        done = _commit(gen, [sampler.pick(logits)], stop_ids, on_tokens)
        committed = len(prompt)  # tokens in the target's cache; gen.tokens[-1] is not yet
        record = AcceptanceRecord()  # the drafter's confidence against what was accepted
        # with measured costs, steps run the drafter (and verify lookups) only where it pays
        choice = HybridChoice(costs) if costs is not None else None
        unread = [context]  # verified features the drafter has not read yet
        while not done and len(gen.tokens) < budget:
            bonus = gen.tokens[-1]
            room = budget - len(gen.tokens) - 1  # the step also commits the target's token
            with gen.timed("draft"):
                drafts = proposer.propose(prompt + gen.tokens)[:room] if proposer else []
                strong = bool(drafts) and proposer.matched >= LOOKUP_MIN_MATCH
                offered = len(drafts)
                if choice is not None:  # verify only the lookup drafts worth their cost
                    drafts = drafts[:choice.lookup_drafts(offered, strong, committed)]
                # lookup: verify the lookup's drafts (maybe none: a plain decode step)
                lookup = strong or (choice is not None and not choice.use_drafter(committed))
                if not lookup:
                    context = unread[0] if len(unread) == 1 else torch.cat(unread)
                    draft_logits, visible = drafter.draft(context, bonus)
                    unread = []
                    drafts, draft_probs = sampler.propose(draft_logits[:room], drafter.vocab)
                    if costs is not None:  # verify only the drafts worth their verify cost
                        confidence = sampler.confidence(draft_logits[:len(drafts)], draft_probs)
                        drafts = drafts[:choose_draft_count(record.calibrate(confidence), committed, costs)]
            with gen.timed("verify"):
                logits, features = target.verify([bonus] + drafts)
                if lookup:  # one-hot drafts: verified as generate_ngram verifies them
                    accepted, following = sampler.verify_deterministic(drafts, logits)
                else:
                    accepted, following = sampler.verify(drafts, logits, draft_probs)
                    if costs is not None:
                        record.update(confidence, len(drafts), accepted)
                if choice is not None:
                    choice.update("lookup" if lookup else "drafter", strong, offered,
                                  len(drafts), accepted)
                committed += accepted + 1
                target.rollback(committed)
            unread.append(features[: accepted + 1])
            gen.step(verified=len(drafts), committed=accepted + 1)
            if lookup:
                gen.ngram_steps += 1
            else:
                gen.visible_per_step.append(visible)
                gen.beta_per_step.append(drafter.scaling.beta(visible) if drafter.scaling else 1.0)
            done = _commit(gen, drafts[:accepted] + [following], stop_ids, on_tokens)
    return gen


def generate_chain(target: Target, drafter: ChainDrafter, prompt: list[int],
                   max_new_tokens: int, sampler: Sampler, stop_ids=frozenset(),
                   on_tokens: OnTokens = None, costs: StepCosts | None = None) -> Generation:
    budget = _budget(target, prompt, max_new_tokens)
    gen = Generation(len(prompt))
    with gen.timed("total"):
        with gen.timed("prefill"):
            logits, features = target.prefill(prompt, len(prompt) + budget)
            drafter.reset(len(prompt) + budget)
            read = len(prompt) if len(prompt) > 1 else 0  # the drafter's own prefill
            if read:  # (as _drafter_prefill): all but the last row of features
                drafter.read(prompt, None if features is None else features[:-1])
                features = None if features is None else features[-1:]
        done = _commit(gen, [sampler.pick(logits)], stop_ids, on_tokens)
        unread = prompt[read:] + gen.tokens  # what the drafter has not read yet
        committed = len(prompt)  # tokens in the target's cache; gen.tokens[-1] is not yet
        record = AcceptanceRecord()  # the drafter's confidence against what was accepted
        while not done and len(gen.tokens) < budget:
            room = budget - len(gen.tokens) - 1  # the step also commits the target's token
            drafts, draft_probs = [], None  # no room: the last step is a plain decode step
            if room > 0:
                with gen.timed("draft"):
                    proposal = drafter.draft(unread, features, min(drafter.max_drafts, room), sampler)
                    drafts, draft_probs = proposal.tokens, proposal.probs
                    if costs is not None:  # verify only the drafts worth their verify cost
                        confidence = sampler.confidence(proposal.logits, draft_probs)
                        drafts = drafts[:choose_draft_count(record.calibrate(confidence), committed, costs)]
                # N of the first draft row: the row whose acceptance every other one needs
                visible = int(proposal.visible[0])
                gen.visible_per_step.append(visible)
                gen.beta_per_step.append(drafter.scaling.beta(visible) if drafter.scaling else 1.0)
            with gen.timed("verify"):
                logits, verified = target.verify(gen.tokens[-1:] + drafts)
                accepted, following = sampler.verify(drafts, logits, draft_probs)
                if costs is not None and room > 0:
                    record.update(confidence, len(drafts), accepted)
                committed += accepted + 1
                target.rollback(committed)
            unread = drafts[:accepted] + [following]
            features = None if verified is None else verified[: accepted + 1]
            gen.step(verified=len(drafts), committed=accepted + 1)
            done = _commit(gen, unread, stop_ids, on_tokens)
    return gen


def generate_tree(target: Target, drafter: TreeDrafter, prompt: list[int], max_new_tokens: int,
                  sampler: Sampler, shape: TreeShape = TreeShape(), stop_ids=frozenset(),
                  on_tokens: OnTokens = None) -> Generation:
    if not sampler.sampling.greedy:
        raise ValueError("tree speculation verifies greedily; to sample, draft a chain "
                         "(EAGLE-3: top_k 1, build_engine.py --tree-top-k 1)")
    budget = _budget(target, prompt, max_new_tokens)
    gen = Generation(len(prompt))
    with gen.timed("total"):
        with gen.timed("prefill"):
            logits, context = target.prefill(prompt, len(prompt) + budget)
            drafter.reset(len(prompt) + budget)
            if len(context) > 1:  # the drafter's own prefill (as _drafter_prefill)
                drafter.read(prompt[1:], context[:-1])
                context = context[-1:]
        done = _commit(gen, [sampler.pick(logits)], stop_ids, on_tokens)
        # the token after each context row
        following = prompt[len(prompt) - len(context) + 1:] + gen.tokens[-1:]
        while not done and len(gen.tokens) < budget:
            room = budget - len(gen.tokens) - 1  # the step also commits the target's token
            with gen.timed("draft"):
                tree, visible = (drafter.draft_tree(context, following, shape.within(room)) if room
                                 else (DraftTree.root_only(gen.tokens[-1]), None))
            with gen.timed("verify"):
                logits, features = target.verify_tree(tree)
                path, token = tree.greedy_path(greedy_choice(logits).tolist())
                target.keep_path(path)
            following = [tree.tokens[i] for i in path[1:]] + [token]
            context = features[path]
            gen.step(verified=len(tree) - 1, committed=len(path))
            if visible is not None:
                gen.visible_per_step.append(visible)
                gen.beta_per_step.append(drafter.scaling.beta(visible) if drafter.scaling else 1.0)
            done = _commit(gen, following, stop_ids, on_tokens)
    return gen


def generate_ngram(target: Target, proposer: NGramProposer, prompt: list[int],
                   max_new_tokens: int, sampler: Sampler, stop_ids=frozenset(),
                   on_tokens: OnTokens = None) -> Generation:
    budget = _budget(target, prompt, max_new_tokens)
    gen = Generation(len(prompt))
    with gen.timed("total"):
        with gen.timed("prefill"):
            logits, _ = target.prefill(prompt, len(prompt) + budget)
        done = _commit(gen, [sampler.pick(logits)], stop_ids, on_tokens)
        committed = len(prompt)  # tokens in the target's cache; gen.tokens[-1] is not yet
        while not done and len(gen.tokens) < budget:
            last = gen.tokens[-1]
            with gen.timed("draft"):
                room = budget - len(gen.tokens) - 1  # the step also commits the target's token
                drafts = proposer.propose(prompt + gen.tokens)[:room]
            with gen.timed("verify"):  # no drafts: a plain one-token decode step
                logits, _ = target.verify([last] + drafts)
                accepted, following = sampler.verify_deterministic(drafts, logits)
                committed += accepted + 1
                target.rollback(committed)
            gen.step(verified=len(drafts), committed=accepted + 1)
            done = _commit(gen, drafts[:accepted] + [following], stop_ids, on_tokens)
    return gen
