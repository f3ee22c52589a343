"""TridentMQ audit-stream jobs. Spark itself is installed only where the jobs run."""
