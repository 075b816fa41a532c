"""Measurement and A/B scripts, run from the repository root as `python -m scripts.NAME`
(so `plugins`, `runtime` and `build` import as packages, with no sys.path edits)."""
