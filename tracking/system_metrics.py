"""CPU, memory and network metrics of a job's own run: MLflow's SystemMetricsMonitor
on a run the hooks created (it samples and logs from its own thread).

Off with ``DILOCO_SYSTEM_METRICS=off``; without psutil it is off, said once.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from tracking.exit_threads import join_before_exit, join_thread

log = logging.getLogger(__name__)


class SystemMonitors:
    """One monitor per run this process's job is about, by run key."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._monitors: dict[str, Any] = {}
        self._stopping: list[threading.Thread] = []

    def start(self, key: str, run_id: str, *, tracking_uri: str | None, resumed: bool) -> None:
        if not self.enabled or key in self._monitors:
            return
        try:
            from mlflow.system_metrics.system_metrics_monitor import (  # noqa: PLC0415
                SystemMetricsMonitor,
            )
        except ImportError as exc:
            log.info("MLflow system metrics off: %s (install psutil to have them)", exc)
            self.enabled = False
            return
        try:
            monitor = SystemMetricsMonitor(run_id, resume_logging=resumed,
                                           tracking_uri=tracking_uri)
            monitor.start()
            self._monitors[key] = monitor
        except Exception as exc:  # noqa: BLE001 - never stop tracking for it
            log.info("MLflow system metrics not started for %s: %s", key, exc)

    def stop(self, key: str, wait: float = 2.0) -> None:
        monitor = self._monitors.pop(key, None)
        if monitor is None:
            return
        # finish() joins the sampling thread, which may be in a request: bounded here,
        # and the process's exit waits for the rest (tracking/exit_threads.py)
        stopper = threading.Thread(target=monitor.finish, daemon=True,
                                   name=f"stop-system-metrics-{key}")
        stopper.start()
        stopper.join(wait)
        if stopper.is_alive():
            self._stopping.append(stopper)
            join_before_exit(stopper)

    def stop_all(self, wait: float) -> None:
        self.enabled = False  # closing: none starts after this (a late run's thread)
        for key in list(self._monitors):
            self.stop(key, wait)

    def join_all(self) -> None:
        """At exit: wait for the monitors still stopping (`stop` gave up on them)."""
        for stopper in self._stopping:
            join_thread(stopper)
