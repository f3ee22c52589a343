"""TridentMQ core broker."""
