"""Committed token ids -> text deltas, for every place that streams text (the terminal in
`python -m runtime generate`, the served model's streaming responses)."""

from __future__ import annotations


class TextStream:
    """Turns committed token ids into text deltas whose concatenation is exactly
    decode(all ids), holding back a trailing partial UTF-8 character until it completes."""

    def __init__(self, decode):
        self.decode, self.ids, self.sent = decode, [], ""

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):  # a byte-level token split a character: wait for the rest
            return ""
        return self._take(text)

    def flush(self) -> str:
        return self._take(self.decode(self.ids))

    def _take(self, text: str) -> str:
        # Byte-level BPE decodes prefix-stably, so the new text extends what was sent.
        delta, self.sent = text[len(self.sent):], text
        return delta
