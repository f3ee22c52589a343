"""TridentMQ stomp gateway. Only the package exists so far; the gateway arrives with its own issue."""
