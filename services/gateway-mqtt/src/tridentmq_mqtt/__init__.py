"""TridentMQ mqtt gateway. Only the package exists so far; the gateway arrives with its own issue."""
