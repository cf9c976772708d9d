"""Command lines: flags only; each forwards to a library function."""
