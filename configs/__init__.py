"""Ready experiment configs (TOML). A package only so that they ship with the wheel: an
installed gradbed finds them by name (``gradbed run demo.toml``, ``controller.paths``)."""
