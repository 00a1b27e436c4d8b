"""What the residency manager and the tail writer record per request and in total.

A request's device pages by role (hot cache, tail, optional history, copies in flight)
and the counters of reclaims and host writes; both modules update them, neither owns
the other's logic.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .transfers import Transfer


@dataclass
class PendingPage:
    device_page: int
    transfer: Transfer = field(default_factory=Transfer)  # the host->device copy


@dataclass
class RequestPages:
    req_id: str
    admitted: int
    max_rows: int
    eligible_pages: int  # complete pages of imported history (optional residency covers these)
    hot: list[int]
    tail_free: list[int]  # reserved tail pages not bound to a history page
    tail: dict[int, int] = field(default_factory=dict)  # history page -> device page (published)
    optional: dict[int, int] = field(default_factory=dict)  # history page -> device page (ready)
    pending: dict[int, PendingPage] = field(default_factory=dict)  # history page -> copy in flight
    backups: list = field(default_factory=list)  # [(tail history page, PendingBackup)]

    @property
    def required_pages(self) -> int:
        return len(self.hot) + len(self.tail) + len(self.tail_free)

    @property
    def held_optional(self) -> int:
        """a_r of eq. 4: pages a reclaim of this request returns."""
        return len(self.optional) + len(self.pending)

    def owned_pages(self) -> list[int]:
        return (self.hot + self.tail_free + list(self.tail.values())
                + list(self.optional.values()) + [p.device_page for p in self.pending.values()])


@dataclass
class ResidencyCounters:
    reclaim_events: int = 0  # admissions that reclaimed at least one request
    requests_reclaimed: int = 0
    pages_reclaimed: int = 0
    pages_repopulated: int = 0  # published after their copy completed
    host_pages_written: int = 0
    host_backups_deferred: int = 0  # imported pages kept on device without a host copy
