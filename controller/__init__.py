"""Runs experiments: config, topology, agents, shaping, traces, teardown, and the CLI."""
