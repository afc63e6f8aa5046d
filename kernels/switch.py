"""The environment switch every kernel here reads: auto (run the kernel where its probe
passes), off (the op path), force (run it without the probe)."""

from __future__ import annotations

import os

CHOICES = ("auto", "off", "force")


def kernel_switch(variable: str, default: str = "auto") -> str:
    """The value of `variable` (default when unset); anything but CHOICES is refused by name
    before any kernel runs, rather than read as auto."""
    value = os.environ.get(variable, default).strip().lower()
    if value not in CHOICES:
        raise ValueError(
            f"{variable}={os.environ[variable]!r}: must be one of {', '.join(CHOICES)}"
        )
    return value


def switched(variable: str, ready, default: str = "auto") -> bool | None:
    """What the switch `variable` (unset: `default`) decides without a probe: False where it
    is off or `ready()` (what the probe needs first) is not, True where it is force, else
    None (the caller probes)."""
    choice = kernel_switch(variable, default)
    if choice == "off" or not ready():
        return False
    return True if choice == "force" else None
