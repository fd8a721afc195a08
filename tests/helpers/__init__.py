"""Shared helpers for the test suite (multi-process harness, state fixtures)."""
