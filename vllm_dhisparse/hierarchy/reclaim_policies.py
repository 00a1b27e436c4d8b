"""Reclaim orders: which admitted requests give up their optional pages first (eq. 4).

When an admission leaves a deficit of Δ pages, the residency manager walks the
admitted requests in a policy's order r_1, r_2, ... and reclaims the *whole*
optional history of the first q of them, with

    q = min { q' : a_{r_1} + ... + a_{r_q'} >= Δ }          (eq. 4)

where a_r is the number of optional pages request r holds.  The other
requests keep their pages.  A policy only orders candidates; the prefix rule
lives in :func:`select_victims` so every policy obeys eq. 4 the same way.

Policies are small classes in a registry (``RECLAIM_POLICIES``); an unknown
name raises ``ValueError`` listing the supported ones.  Orders are total
(ties broken by admission order, then id) so a replayed sequence reclaims the
same requests.
"""
from __future__ import annotations

from typing import NamedTuple


class ReclaimCandidate(NamedTuple):
    """Immutable; a tuple, as an admission lists every admitted request of a source."""
    req_id: str
    admitted: int  # admission order, smaller = admitted earlier
    last_active: int  # last step the request produced rows
    pages: int | None = None  # a_r of eq. 4; None counts as 0


def _pages(c: ReclaimCandidate) -> int:
    return c.pages or 0


class ReclaimPolicy:
    name = ""

    def key(self, c: ReclaimCandidate):
        raise NotImplementedError

    def order(self, candidates: list[ReclaimCandidate]) -> list[ReclaimCandidate]:
        return sorted(candidates, key=self.key)


class LargestFirst(ReclaimPolicy):
    """Largest a_r first (the DEFAULT).

    Taking the biggest holders first makes the prefix of eq. 4 as short as it
    can be for a greedy walk: the fewest requests are disturbed (lose their
    direct-map coverage) to cover Δ, and everyone else keeps their pages.
    """
    name = "largest_first"

    def key(self, c):
        return (-_pages(c), c.admitted, c.req_id)


class OldestFirst(ReclaimPolicy):
    """Earliest admitted first: long-running requests are nearest completion and
    have had the most time to warm their hot caches."""
    name = "oldest_first"

    def key(self, c):
        return (c.admitted, c.req_id)


class LeastRecentlyActive(ReclaimPolicy):
    """Longest idle first (e.g. requests stalled behind a scheduler decision):
    their direct-map coverage is buying the least right now."""
    name = "least_recently_active"

    def key(self, c):
        return (c.last_active, c.admitted, c.req_id)


RECLAIM_POLICIES: dict[str, type[ReclaimPolicy]] = {
    cls.name: cls for cls in (LargestFirst, OldestFirst, LeastRecentlyActive)
}
DEFAULT_RECLAIM_POLICY = LargestFirst.name


def get_reclaim_policy(name: str) -> ReclaimPolicy:
    if name not in RECLAIM_POLICIES:
        raise ValueError(f"unknown reclaim policy {name!r}; supported: {sorted(RECLAIM_POLICIES)}")
    return RECLAIM_POLICIES[name]()


def select_victims(policy: ReclaimPolicy, candidates: list[ReclaimCandidate],
                   deficit: int) -> list[str] | None:
    """Eq. 4: ids of the shortest policy-ordered prefix whose pages cover ``deficit``.

    Returns ``[]`` when there is no deficit and ``None`` when all candidates
    together cannot cover it: the admission must wait and nothing is reclaimed.
    """
    if deficit <= 0:
        return []
    holders = [c for c in candidates if c.pages]
    if sum(c.pages for c in holders) < deficit:
        return None
    victims, covered = [], 0
    for c in policy.order(holders):
        victims.append(c.req_id)
        covered += _pages(c)
        if covered >= deficit:
            return victims
    raise AssertionError("unreachable: total covers the deficit")  # pragma: no cover
