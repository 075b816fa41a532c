"""How results show each decoding mode: its plot colour, its legend label and the word a
results table heads its column with. Presentation only, kept beside the commands that
draw and print (bench's plot, the demo's table, the results report) and read by
scripts/plot_families.py; runtime/modes.py says what a mode is, never how it looks
(TensorRT-LLM's SpeculativeDecodingMode: predicates, no display data)."""

from __future__ import annotations

from typing import NamedTuple

from runtime.modes import Mode


class Style(NamedTuple):
    color: str  # matplotlib colour
    label: str  # legend and demo-table label
    word: str  # a results table's column heading


STYLES = {
    Mode.TARGET: Style("black", "target-only", "target-only"),
    Mode.NGRAM: Style("tab:green", "n-gram lookup", "n-gram"),
    Mode.FROZEN: Style("tab:gray", "frozen drafter", "frozen"),
    Mode.WINDOW: Style("tab:brown", "frozen, draft window", "window"),
    Mode.PRESET: Style("tab:orange", "SharpDraft, family preset", "preset"),
    Mode.SHARPDRAFT: Style("tab:blue", "SharpDraft", "SharpDraft"),
    Mode.HYBRID: Style("tab:purple", "SharpDraft + n-gram", "SharpDraft + n-gram"),
    Mode.FROZEN_HYBRID: Style("tab:olive", "frozen + n-gram", "frozen + n-gram"),
    Mode.WINDOW_HYBRID: Style("tab:pink", "draft window + n-gram", "window + n-gram"),
}
