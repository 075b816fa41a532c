#!/usr/bin/env bash
# Same-window A/B of the decode loop: old code (/work/wt-before, 2f5c9ad) and new (main),
# alternating, same bench command; the loop's cost shows in every mode's tok/s.
cd /work/main
for r in 1 2; do
  for side in before after; do
    dir=/work/main; [ $side = before ] && dir=/work/wt-before
    echo "=== $(date +%T) $side $r" >> /work/logs/ab.log
    (cd $dir && .venv/bin/python -m runtime bench --engine-dir engines/dflash-sharpdraft --lengths 512 \
       --new-tokens 64 --repeats 2 --max-docs 1 --modes sharpdraft hybrid ngram --json /work/logs/ab-$side-$r.json > /dev/null 2>> /work/logs/ab.err)
  done
done
echo "=== $(date +%T) done" >> /work/logs/ab.log
