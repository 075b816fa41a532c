"""The `python -m runtime` commands, one module each (`add_parser(subparsers)`, `run(args)`).

The top layer: commands may use build/ (calibrate re-exports graphs, demo builds the
default engine); nothing below them imports this package."""
