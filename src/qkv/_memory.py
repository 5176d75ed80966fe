"""How much memory this process may still take, before it asks for a large amount.

The least of three limits, each where the system tells it: the memory the system has
available (``MemAvailable`` of ``/proc/meminfo``), what the process's cgroup still allows (a
container's limit), and what its address-space limit (``ulimit -v``, ``RLIMIT_AS``) leaves.
A command that is about to build something large (a Hugging Face model from its config)
compares its estimate with this and refuses, in one line with both numbers, what would not
fit, instead of being killed halfway or swapping the machine to a halt.

Example:
    >>> available = available_memory()
    >>> available is None or available >= 0
    True
    >>> physical_memory() > 0
    True
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["available_memory", "physical_memory"]


def physical_memory() -> int:
    """The machine's physical memory, bytes (what no estimate may exceed, whatever is free)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory() -> int | None:
    """The bytes this process may still allocate (None when the system does not say)."""
    limits = [n for n in (_system(), _cgroup(), _address_space()) if n is not None]
    return max(0, min(limits)) if limits else None


def _read_number(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdecimal() else None


def _field_kib(path: str, field: str) -> int | None:
    """A ``Field:   123 kB`` line of a ``/proc`` file, in bytes."""
    try:
        with open(path, encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return None
    return None


def _system() -> int | None:
    found = _field_kib("/proc/meminfo", "MemAvailable")
    if found is not None:
        return found
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup() -> int | None:
    """The cgroup's limit less its usage (cgroup v2, else v1), or None without a limit."""
    root = Path("/sys/fs/cgroup")
    own = ""
    try:
        for line in Path("/proc/self/cgroup").read_text(encoding="utf-8").splitlines():
            if line.startswith("0::"):
                own = line[3:].strip().lstrip("/")
    except OSError:
        pass
    for folder, limit, usage in (
        (root / own, "memory.max", "memory.current"),
        (root, "memory.max", "memory.current"),
        (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"),
    ):
        most, used = _read_number(folder / limit), _read_number(folder / usage)
        if most is not None and most < 1 << 60 and used is not None:  # v1 writes 2⁶³ for none
            return most - used
    return None


def _address_space() -> int | None:
    """``RLIMIT_AS`` less the address space already mapped, or None without a limit."""
    try:
        import resource
    except ImportError:  # not on this system (Windows)
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    mapped = _field_kib("/proc/self/status", "VmSize") or 0
    return soft - mapped
