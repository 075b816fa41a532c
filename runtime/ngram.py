"""N-gram (prompt-lookup) drafting: a drafter-free proposer.

The drafts are the tokens that followed the most recent earlier occurrence of the
context's last n tokens (n from max_ngram down to min_ngram), as TensorRT-LLM and vLLM
(NGram) and transformers (prompt lookup) do. Lookup in runtime/proposers.py
verifies them; they carry no distribution, so verification treats them as one-hot.
"""

from __future__ import annotations


def _check_count(name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def _ngram_keys(tokens: list[int], end: int, longest: int) -> list[int]:
    """The n-grams ending just before `end`, n = 1..longest, each as one int (32 bits a
    token id). Int keys, unlike tuples, are not tracked by the garbage collector: with
    tuple keys, indexing an 8K-token prompt in a process holding torch set off a full
    collection (~90 ms, against ~10 ms for the indexing itself)."""
    keys, key = [], 0
    for n in range(1, min(longest, end) + 1):
        key |= tokens[end - n] << (32 * (n - 1))
        keys.append(key)
    return keys


class NGramProposer:
    """propose(tokens) -> up to num_draft_tokens tokens, or [] when nothing matches.

    The lookup index (for each n, n-gram -> where its latest occurrence ends) is extended
    with only the tokens added since the last call, so a step costs O(new tokens) in
    Python (plus a C-speed prefix compare), not a scan of the context. A call with tokens
    that do not extend the previous ones rebuilds it from scratch. After a call, `matched`
    is the n of the n-gram the proposal followed (0: nothing matched).
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_draft_tokens: int = 4):
        _check_count("min_ngram", min_ngram, 1)
        _check_count("max_ngram", max_ngram, min_ngram)
        _check_count("num_draft_tokens", num_draft_tokens, 1)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.num_draft_tokens = num_draft_tokens
        self.matched = 0
        self._tokens: list[int] = []  # the tokens the index covers
        self._latest_end = {n: {} for n in range(min_ngram, max_ngram + 1)}

    def settings(self) -> dict:
        """What engine.json records; from_settings reads it back."""
        return {"method": "ngram", "max_ngram": self.max_ngram, "min_ngram": self.min_ngram,
                "num_draft_tokens": self.num_draft_tokens}

    @classmethod
    def from_settings(cls, settings: dict) -> "NGramProposer":
        if settings.get("method") != "ngram":
            raise ValueError(f"not n-gram drafting settings: method {settings.get('method')!r}")
        return cls(settings["max_ngram"], settings["min_ngram"], settings["num_draft_tokens"])

    def propose(self, tokens: list[int]) -> list[int]:
        self._index(tokens)
        suffixes = _ngram_keys(tokens, len(tokens), self.max_ngram)
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            end = self._latest_end[n].get(suffixes[n - 1])
            if end is not None:
                self.matched = n
                return tokens[end: end + self.num_draft_tokens]
        self.matched = 0
        return []

    def _index(self, tokens: list[int]) -> None:
        seen = len(self._tokens)
        if len(tokens) < seen or tokens[:seen] != self._tokens:
            seen = 0
            self._latest_end = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
        # An n-gram ending at `end` is indexed once tokens[end] (its first follower) exists,
        # so the context's own last n tokens never match themselves. Later ends overwrite
        # earlier ones: the most recent occurrence wins.
        for end in range(max(seen, 1), len(tokens)):
            for n, key in enumerate(_ngram_keys(tokens, end, self.max_ngram), start=1):
                if n >= self.min_ngram:
                    self._latest_end[n][key] = end
        self._tokens = list(tokens)
