"""Network descriptions as pure data, and the builders that make them real in Mininet."""
