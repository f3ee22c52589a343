"""Clustering's shell: discovery, the cluster connections (bridges) and their manager. The pure parts it
drives (other nodes' bindings, balancing, forwarding, redistribution) are core modules, which never
import this package."""
