"""The ``diloco`` command: run, follow, resume, cancel and deploy training runs.

    diloco run                          # the embedded default: tiny recipe, two local "regions"
    diloco run small --set train.steps=2000  # a shipped recipe, or a YAML file of yours
    diloco status tiny-20260101-120000  # a run URL, or a run's name under runs/
    diloco resume tiny-20260101-120000
    diloco cancel tiny-20260101-120000
    diloco gc tiny-20260101-120000      # --apply deletes what resume and audit no longer need
    diloco join tiny-20260101-120000 --worker region-c   # and diloco leave ... --worker W
    diloco run --store local-s3         # the same on SeaweedFS, a real S3 server here
    diloco deploy                       # infra/prefect.yaml on $PREFECT_API_URL
    diloco bucket setup s3://b/runs --workers region-a,region-b --dry-run
    diloco prepare-data builtin:shakespeare --out runs/data/shakespeare
    diloco export tiny-20260101-120000 --out my-model   # transformers loads my-model/
    diloco sample tiny-20260101-120000 --prompt "ROMEO:"

Each command lives in its own module of this package; this one builds the app.
"""

from __future__ import annotations

import sys

import typer

from cli.bench import bench
from cli.bucket import bucket_app
from cli.compare import compare_command
from cli.data import prepare_data
from cli.deploy import deploy
from cli.estimate import estimate
from cli.gc import gc
from cli.members import join, leave
from cli.model import export, sample
from cli.run import resume, run
from cli.status import cancel, status
from cli.store import store_app
from tracking.exit_threads import record_threads_at_exit

HELP = """Train one language model across regions with Streaming DiLoCo.

\b
  diloco run                   the embedded default: tiny recipe, two local "regions"
  diloco run small --set train.steps=2000
  diloco status RUN            RUN: a run URL, or a run's name under runs/
  diloco resume RUN
  diloco cancel RUN
  diloco gc RUN [--apply]      what the run no longer needs (a dry run without --apply)
  diloco join RUN --worker W   add a worker to a running run; diloco leave RUN --worker W
  diloco run --store local-s3  the same on a real S3 server here (SeaweedFS)
  diloco store serve           serve that store to read or resume its runs
  diloco deploy                infra/prefect.yaml on $PREFECT_API_URL
  diloco bucket setup s3://BUCKET/PREFIX --workers a,b [--dry-run]
  diloco prepare-data builtin:shakespeare --out runs/data/shakespeare
  diloco export RUN --out DIR  the canonical model for transformers (safetensors)
  diloco sample RUN --prompt TEXT   a continuation by the canonical model
  diloco estimate --params 1e9 -M 8 -H 100 -P 4 --contenders   bytes, $ and bandwidth

Errors you can act on print one line and exit with status 2 (nothing is launched);
a failed run exits 1, a cancelled one 3, Ctrl-C 130.
"""

# with DILOCO_THREADS_AT_EXIT set (tests): the threads alive at the command's very end
record_threads_at_exit()  # (the first atexit hook of the command: the last to run)

app = typer.Typer(
    name="diloco", help=HELP, no_args_is_help=True, add_completion=False,
    rich_markup_mode=None, pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command()(run)
app.command()(resume)
app.command()(status)
app.command()(cancel)
app.command()(gc)
app.command()(join)
app.command()(leave)
app.command()(deploy)
app.command("prepare-data")(prepare_data)
app.command()(export)
app.command()(sample)
app.command()(bench)
app.command("compare")(compare_command)
app.command()(estimate)
app.add_typer(bucket_app)
app.add_typer(store_app)


if __name__ == "__main__":  # pragma: no cover - the console script calls app()
    sys.exit(app())
