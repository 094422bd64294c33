"""The `diloco` command (typer and rich): parse arguments, call `flows` and
`tracking`, print. A module per command; `cli.app` builds the app.

This package holds no logic of its own about runs: how a run is created, found,
followed or stopped lives in `workers` and `flows`, how it is tracked in
`tracking`. What stays here is what a terminal needs: arguments, one-line errors
with exit status 2, progress bars and tables.

Why some imports are inside the command functions: `diloco --help` and every
command's argument parsing need only the app's modules, and importing torch, Prefect
and MLflow at the top (`flows.train`, `workers.locate`, `workers.data`,
`tracking.compare`, `mlflow`) would make each of them several times slower (the
figures and how they were taken: docs/results.md, "The diloco command's start-up").
So the commands import `flows.train` (Prefect, torch) and the `workers` modules that
bring torch when they run, and only those; each such line says which library it
defers.
"""
