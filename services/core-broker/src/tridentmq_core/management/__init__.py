"""The management HTTP server of a core node: health probes, Prometheus metrics and a JSON API of views and
operations."""

from __future__ import annotations

from tridentmq_core.management.app import NodeStatus, QueueRates, create_app
from tridentmq_core.management.metrics import render_metrics

__all__ = ["NodeStatus", "QueueRates", "create_app", "render_metrics"]
