"""gradbed's test suite: unit tests (no root) and real-Mininet tests marked ``mininet``."""
