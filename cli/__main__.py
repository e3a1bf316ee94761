"""`python -m cli` runs the `compress` command."""

from compresskit.cli.entry import main

main()
