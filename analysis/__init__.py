"""Loads run directories into pandas, computes metrics, plots, reports and plans."""
