"""`python -m transformer_cli ...` is the same as `tfm ...`."""

from .cli import main

main()
