"""The `diloco` command (typer and rich): parse arguments, call `flows` and
`tracking`, print. A module per command; `cli.app` builds the app.

This package holds no logic of its own about runs: how a run is created, found,
followed or stopped lives in `workers` and `flows`, how it is tracked in
`tracking`. What stays here is what a terminal needs: arguments, one-line errors
with exit status 2, progress bars and tables.

Why some imports are inside the command functions (measured on this two-core
machine, 2026-11-24, under a load of about 2): `diloco --help` and every command's
argument parsing take 0.66-0.87 s with the app's modules alone; importing torch,
Prefect and MLflow at the top (`flows.train`, `workers.locate`, `workers.data`,
`tracking.compare`, `mlflow`) makes it 4.3-4.7 s. So the commands import
`flows.train` (Prefect, torch) and the `workers` modules that bring torch when they
run, and only those; each such line says which library it defers.
"""
