"""High availability: replication pairs, quorum votes, epochs, shared store and network checks."""
