"""``python -m tridentmq_shared.cli`` is the ``tridentmq`` command."""

from tridentmq_shared.cli.main import main

main()
