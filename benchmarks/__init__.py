"""Benchmarks: each prints one JSON object as its last line; ``--quick`` runs in < 1 min."""
