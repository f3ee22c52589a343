"""Clustering: discovery, cluster connections, load balancing, redistribution."""
