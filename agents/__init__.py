"""Processes that run inside Mininet hosts: workers, the parameter server, and their codec."""
