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
