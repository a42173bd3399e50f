"""Tiers beyond the local directory: the persistent drain to an object store and
replicas on partner nodes."""
