"""`python -m polyserve.cli`: the `polyserve` command."""

from polyserve.cli import main

main()
