"""Command-line interface: `fitune.cli.main.main` is the console script."""
