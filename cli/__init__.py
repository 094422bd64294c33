"""The `diloco` command (typer and rich): parse arguments, call `flows` and `tracking`, print."""
