"""What the jobs report beyond the store: the seam between orchestration and tracking.

The worker, aggregator and train jobs (``flows/``) call these methods; the default
does nothing, and `tracking.mlflow_hooks.MlflowHooks` implements them with MLflow.
A hook must never stop or slow training: implementations buffer, retry in the
background, and swallow (and count) their own failures.
"""

from __future__ import annotations

from typing import Any


class Hooks:
    """No-op hooks; subclass and override what you need."""

    def run_started(self, config: dict[str, Any], run_url: str, *, resumed: bool,
                    n_params: int | None = None) -> None:
        """The train job created (or continued) the run. ``config`` is the resolved
        RunConfig as a dict; ``n_params`` the model's parameter count (from the run's
        manifest: the sizes of its fragments), which the comparison of runs needs."""

    def worker_started(self, worker: str, info: dict[str, Any]) -> None:
        """A worker job started (``info``: host, island size, resumed_from...)."""

    def worker_metrics(self, worker: str, metrics: dict[str, Any]) -> None:
        """A worker's metrics (the WorkerLoop metrics callback: step, loss, lr,
        tokens_per_s, wait_s, bytes_up, bytes_down, staleness; or step, eval_loss)."""

    def worker_finished(self, worker: str, result: dict[str, Any], state: str) -> None:
        """A worker ended: ``state`` is finished, left (it left the run: ``diloco
        leave``), interrupted, failed or cancelled; ``result`` has its ``rebases``."""

    def aggregator_round(self, report: dict[str, Any]) -> None:
        """The aggregator applied a round: fragment, round, weights, rejected,
        seconds, grad_norm, and when evaluated, eval_loss and perplexity of the
        canonical model, plus bytes_up / bytes_down of the aggregator (cumulative,
        all its traffic) and, optionally, bytes_checkpoints: how many of its bytes up
        were canonical checkpoints (``global/``), shown apart in the totals; late,
        dropped and expected: contributions of earlier rounds applied in this mean,
        contributions dropped as stale, members the round waited for."""

    def aggregator_stalled(self, stalls: list[dict[str, Any]]) -> None:
        """No round was applied for a while: per open (fragment, round), the workers
        still missing and since when (``fragment``, ``round``, ``missing``,
        ``since``, ``waited_s``, ``text``); ``[]`` once rounds are applied again."""

    def run_finished(self, summary: dict[str, Any]) -> None:
        """The train job ended; ``summary`` is its final report."""

    def aggregator_eval(self, report: dict[str, Any]) -> None:
        """The aggregator evaluated the canonical model outside a round report (at the
        end of the run): eval_loss, perplexity, rounds (applied so far), final."""

    def close(self) -> dict[str, int] | None:
        """Flush whatever is buffered (bounded in time); returns what was not logged
        (counts by kind), if anything."""
        return None
