"""Workloads: a model plus its data (real training) or a real model's gradient sizes (replay)."""
