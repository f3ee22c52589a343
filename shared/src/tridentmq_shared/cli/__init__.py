"""The `tridentmq` command line."""
