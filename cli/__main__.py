"""`python -m cli` runs the `compress` command."""

from cli.entry import main

main()
