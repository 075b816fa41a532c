#!/bin/bash
# The three-family result (docs/results.md): MAL against context length for DFlash, PARD and
# EAGLE-3, frozen vs family preset vs calibrated SharpDraft, 8 evaluation documents, 128
# greedy tokens each, whole blocks/chains/trees (--draft-length full: MAL, not speed).
# A family whose JSON exists is kept (FORCE=1 reruns it); FAMILIES picks some (two at once
# with OMP_NUM_THREADS=1 use both cores without stalling each other); once all three JSONs
# exist, the table and the plot.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LENGTHS=${LENGTHS:-512 2048 4096 7680}
declare -A ENGINE=([dflash]=engines/dflash-sharpdraft [pard]=engines/pard-torch [eagle3]=engines/eagle3-torch)
for F in ${FAMILIES:-pard eagle3 dflash}; do
  if [ ! -f "${ENGINE[$F]}/engine.json" ]; then
    $PY build_engine.py --drafter $F --sharpdraft --backend torch --output "${ENGINE[$F]}"
  fi
  OUT=results/families-$F.json
  if [ -f "$OUT" ] && [ -z "${FORCE:-}" ]; then echo "keeping $OUT"; continue; fi
  # the preset swaps the drafter's scaling, which only the torch backend can do per run
  $PY -m runtime bench --engine-dir "${ENGINE[$F]}" --backend torch --modes frozen preset sharpdraft \
      --lengths $LENGTHS --new-tokens 128 --max-docs 8 --repeats 1 --draft-length full \
      --json "$OUT.tmp"
  mv "$OUT.tmp" "$OUT"
done
for F in dflash pard eagle3; do [ -f results/families-$F.json ] || exit 0; done
$PY -m scripts.plot_families results/families-{dflash,pard,eagle3}.json --plot results/families.png \
    > results/families.md
cat results/families.md
