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

import heapq
from typing import NamedTuple


class ReclaimCandidate(NamedTuple):
    """One admitted request as a reclaim order sees it.  Policies read candidates by
    position, so a plain tuple in this field order serves too (an admission lists every
    holder of optional pages, and building NamedTuples cost more than choosing)."""
    req_id: str
    admitted: int  # admission order, smaller = admitted earlier
    last_active: int  # last step the request produced rows
    pages: int | None = None  # a_r of eq. 4; None counts as 0


class ReclaimPolicy:
    name = ""

    def keys(self, candidates: list) -> list[tuple]:
        """The sort key of each candidate, in order; keys end with the request id, so no
        two are equal and the order is total."""
        raise NotImplementedError

    def order(self, candidates: list[ReclaimCandidate]) -> list[ReclaimCandidate]:
        ranked = sorted(zip(self.keys(candidates), range(len(candidates))))
        return [candidates[i] for _, i in ranked]


class LargestFirst(ReclaimPolicy):
    """Largest a_r first (the DEFAULT).

    Taking the biggest holders first makes the prefix of eq. 4 as short as it
    can be for a greedy walk: the fewest requests are disturbed (lose their
    direct-map coverage) to cover Δ, and everyone else keeps their pages.
    """
    name = "largest_first"

    def keys(self, candidates):
        return [(-(pages or 0), admitted, req_id) for req_id, admitted, _, pages in candidates]


class OldestFirst(ReclaimPolicy):
    """Earliest admitted first: long-running requests are nearest completion and
    have had the most time to warm their hot caches."""
    name = "oldest_first"

    def keys(self, candidates):
        return [(admitted, req_id) for req_id, admitted, _, _ in candidates]


class LeastRecentlyActive(ReclaimPolicy):
    """Longest idle first (e.g. requests stalled behind a scheduler decision):
    their direct-map coverage is buying the least right now."""
    name = "least_recently_active"

    def keys(self, candidates):
        return [(last_active, admitted, req_id) for req_id, admitted, last_active, _ in candidates]


RECLAIM_POLICIES: dict[str, type[ReclaimPolicy]] = {
    cls.name: cls for cls in (LargestFirst, OldestFirst, LeastRecentlyActive)
}
DEFAULT_RECLAIM_POLICY = LargestFirst.name


def get_reclaim_policy(name: str) -> ReclaimPolicy:
    if name not in RECLAIM_POLICIES:
        raise ValueError(f"unknown reclaim policy {name!r}; supported: {sorted(RECLAIM_POLICIES)}")
    return RECLAIM_POLICIES[name]()


def select_victims(policy: ReclaimPolicy, candidates: list,
                   deficit: int) -> list[str] | None:
    """Eq. 4: ids of the shortest policy-ordered prefix whose pages cover ``deficit``.

    Returns ``[]`` when there is no deficit and ``None`` when all candidates
    together cannot cover it: the admission must wait and nothing is reclaimed.
    Only the prefix is put in order (a heap of all holders, popped until covered):
    an admission takes a few victims out of every admitted request.
    """
    if deficit <= 0:
        return []
    holders = [c for c in candidates if c[3]]
    if sum(c[3] for c in holders) < deficit:
        return None
    heap = list(zip(policy.keys(holders), holders))  # keys are distinct: holders never compared
    heapq.heapify(heap)
    victims, covered = [], 0
    while covered < deficit:
        _, c = heapq.heappop(heap)
        victims.append(c[0])
        covered += c[3]
    return victims
