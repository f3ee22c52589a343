"""Persistence behind the ``Store`` protocol: memory now, the journal in its own issue."""
