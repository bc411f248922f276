"""Counters every storage tier keeps, and the warning a tier gives when it stops writing."""

from __future__ import annotations

from dataclasses import asdict, dataclass


class TierDegradedWarning(RuntimeWarning):
    """A tier hit a fault it cannot fix itself (full or read-only disk) and stopped writing; reads go on."""


@dataclass
class TierStats:
    """What a tier did since it was created (per instance: another process sharing a directory counts its own)."""

    hits: int = 0
    misses: int = 0  # every get that returned nothing, corrupt and expired ones included
    corrupt: int = 0  # stored items that failed their checks (removed, never returned)
    writes: int = 0  # items stored
    skipped: int = 0  # puts dropped: degraded tier, an item larger than the budget, or already stored
    write_errors: int = 0  # puts that failed with an OS error
    bytes_written: int = 0
    bytes_read: int = 0
    evictions: int = 0  # items dropped to keep within the byte budget (least recently used first)
    expired: int = 0  # items dropped because their last use was longer ago than the retention time

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
