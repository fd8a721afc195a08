"""Worker entry points started as real OS processes by the multi-process tests."""
