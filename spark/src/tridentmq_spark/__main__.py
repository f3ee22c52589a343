"""``python -m tridentmq_spark`` (also the script spark-submit runs)."""

from tridentmq_spark.cli import main

main()
