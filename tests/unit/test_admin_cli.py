"""The management CLI's HTTP client (``tridentmq_shared.cli.admin``): what an operator's mistake gets."""

from __future__ import annotations

import pytest

from tridentmq_shared.cli import admin


@pytest.mark.parametrize("url", ["localhost", "http://h:81x1", "http://[::1"])
def test_a_malformed_management_url_is_an_error_that_names_it(url: str) -> None:
    """Not a traceback: ``tridentmq`` prints an ``AdminError`` as one line and exits 1."""
    with pytest.raises(admin.AdminError, match="bad management URL"):
        admin.fetch(url, "/api/status")


def test_the_cluster_view_reads_the_other_nodes_over_https_when_the_node_asked_was() -> None:
    """Its credentials must not go in clear to a node that serves HTTPS: the scheme follows --management."""
    member = {"name": "n2", "node_id": "0f1e2d3c", "host": "127.0.0.1", "port": 61617, "management": 1}
    [plain] = admin.cluster_nodes({"members": [member]}, ("admin", "secret"))
    [tls] = admin.cluster_nodes({"members": [member]}, ("admin", "secret"), tls=True)
    assert "http://127.0.0.1:1/" in plain["error"]
    assert "https://127.0.0.1:1/" in tls["error"]


def test_the_status_text_counts_sessions_and_the_link_connections_carrying_them() -> None:
    """``connections`` counts link sessions, ``links`` the link connections (docs/management.md): the text said
    ``links 11`` for 11 sessions over 5 connections."""
    text = admin.status_text({"name": "core", "node_id": "n", "connections": 11, "links": 5, "counters": {}})
    assert "sessions    11 over 5 link connection(s)" in text
    assert "links       11" not in text
