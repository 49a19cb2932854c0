"""Capacity planning and trace-driven simulation. Pure Python (no torch)."""
