"""Trace formats and replay: bandwidth traces, flow sizes, gradient-size profiles."""
