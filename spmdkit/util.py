"""Human-readable byte counts, shared by every table spmdkit prints."""

from __future__ import annotations

__all__ = ["fmt_bytes"]


def fmt_bytes(n: float) -> str:
    """``512 B``, ``8.0 KiB``, ``1.5 GiB``… (binary units).

    Example::

        >>> fmt_bytes(8192)
        '8.0 KiB'
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
