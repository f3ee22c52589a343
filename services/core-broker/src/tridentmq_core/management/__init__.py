"""The management HTTP server of a core node: health probes, Prometheus metrics and a JSON API of views and
operations."""

from __future__ import annotations

from tridentmq_core.management.app import create_app
from tridentmq_core.management.metrics import render_metrics
from tridentmq_core.management.status import NodeStatus, QueueRates

__all__ = ["NodeStatus", "QueueRates", "create_app", "render_metrics"]
