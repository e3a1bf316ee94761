"""`python -m cli` runs the `compress` command."""

from cli.main import main

main()
