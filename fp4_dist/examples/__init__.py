"""Deprecated home of the example applications, now ``examples/`` at the repository root (not installed)."""
