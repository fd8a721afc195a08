"""Tiny worker scripts and a process harness for the ``checkpointless run`` tests."""
