"""A config with one bad value in every section, for the tests that check that a config's
errors are all reported in one go (the unit check and the ``gradbed run`` one)."""

from __future__ import annotations

# One bad value in every section: the field each must report. A new section without an entry
# here fails test_one_bad_value_in_every_section_is_reported_at_once, so it is covered too.
BAD_IN_EVERY_SECTION: dict[str, tuple[str, object]] = {
    "run": ("iterations", 0),
    "net": ("workers", 0),
    "workload": ("lr", 0),
    "compress": ("ratio", 2.0),
    "shaping": ("method", "magic"),
    "adaptive": ("eps", 5.0),
    "trace": ("scale", 0),
    "membership": ("schedule", [[0, 5, 3]]),
    "background": ("kind", "nope"),
    "topo": ("hosts", 100),
    "guard": ("max_abs_grad", -1.0),
    "moe": ("top_k", 5),
    "pipeline": ("schedule", "zigzag"),
    "vision": ("vit_patch", 3),
    "feedback": ("warmup_iterations", -1),
}


def bad_config_toml() -> str:
    """A config with one bad value in every section (and two in [guard] and [pipeline],
    whose second check used to be lost behind the first)."""
    lines: list[str] = []
    for section, (name, value) in BAD_IN_EVERY_SECTION.items():
        lines += [f"[{section}]", f"{name} = {value!r}".replace("'", '"')]
        if section == "guard":
            lines.append("handshake_timeout_s = 0")
        if section == "pipeline":
            lines.append("ratio = 0")
    return "\n".join(lines) + "\n"
