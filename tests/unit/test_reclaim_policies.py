import itertools

import pytest

from vllm_dhisparse.hierarchy.reclaim_policies import (DEFAULT_RECLAIM_POLICY, RECLAIM_POLICIES,
                                                       ReclaimCandidate, get_reclaim_policy,
                                                       select_victims)

CANDS = [ReclaimCandidate("a", admitted=0, last_active=9, pages=2),
         ReclaimCandidate("b", admitted=1, last_active=3, pages=7),
         ReclaimCandidate("c", admitted=2, last_active=5, pages=0),
         ReclaimCandidate("d", admitted=3, last_active=1, pages=4),
         ReclaimCandidate("e", admitted=4, last_active=1, pages=None)]


def verify_eq4(order, victims, deficit):
    """victims is the shortest prefix of the order (pages > 0) covering deficit."""
    pages = {c.req_id: c.pages or 0 for c in order}
    walk = [c.req_id for c in order if (c.pages or 0) > 0]
    assert victims == walk[:len(victims)]
    assert sum(pages[v] for v in victims) >= deficit
    assert sum(pages[v] for v in victims[:-1]) < deficit


@pytest.mark.parametrize("name", sorted(RECLAIM_POLICIES))
def test_order_is_total_and_deterministic(name):
    policy = get_reclaim_policy(name)
    for perm in itertools.permutations(CANDS):
        assert policy.order(list(perm)) == policy.order(CANDS)
    assert sorted(c.req_id for c in policy.order(CANDS)) == list("abcde")


@pytest.mark.parametrize("name", sorted(RECLAIM_POLICIES))
@pytest.mark.parametrize("deficit", range(1, 14))
def test_victims_obey_eq4(name, deficit):
    policy = get_reclaim_policy(name)
    victims = select_victims(policy, CANDS, deficit)
    assert victims is not None
    verify_eq4(policy.order(CANDS), victims, deficit)
    assert "c" not in victims and "e" not in victims  # nothing to give, never disturbed


@pytest.mark.parametrize("name", sorted(RECLAIM_POLICIES))
def test_wait_and_no_deficit(name):
    policy = get_reclaim_policy(name)
    assert select_victims(policy, CANDS, 14) is None  # 13 pages cannot cover 14: wait
    assert select_victims(policy, CANDS, 0) == [] and select_victims(policy, [], -3) == []
    assert select_victims(policy, [], 1) is None


def test_named_orders():
    ids = lambda name: [c.req_id for c in get_reclaim_policy(name).order(CANDS)]
    assert ids("largest_first") == ["b", "d", "a", "c", "e"]
    assert ids("oldest_first") == ["a", "b", "c", "d", "e"]
    assert ids("least_recently_active") == ["d", "e", "b", "c", "a"]


def test_default_is_largest_first_fewest_disturbed():
    assert DEFAULT_RECLAIM_POLICY == "largest_first"
    assert "fewest requests" in RECLAIM_POLICIES["largest_first"].__doc__
    assert select_victims(get_reclaim_policy("largest_first"), CANDS, 7) == ["b"]
    assert select_victims(get_reclaim_policy("oldest_first"), CANDS, 7) == ["a", "b"]


def test_unknown_name_lists_supported():
    with pytest.raises(ValueError) as e:
        get_reclaim_policy("random")
    for name in RECLAIM_POLICIES:
        assert name in str(e.value)
    assert "'random'" in str(e.value)


# each policy's order written out field by field, apart from the policies' own keys
SPELLED_OUT = {
    "largest_first": lambda c: (-(c[3] or 0), c[1], c[0]),
    "oldest_first": lambda c: (c[1], c[0]),
    "least_recently_active": lambda c: (c[2], c[1], c[0]),
}


@pytest.mark.parametrize("name", sorted(RECLAIM_POLICIES))
def test_many_candidates_with_ties_as_plain_tuples(name):
    """An admission hands every holder over as a plain tuple: among hundreds of requests
    with tied pages, admission steps and activity, the victims are still the eq. 4 prefix
    of the full order, whichever order the candidates come in."""
    import random
    rng = random.Random(7)
    policy = get_reclaim_policy(name)
    for trial in range(20):
        cands = [(f"r{i:03d}", rng.randrange(50), rng.randrange(5), rng.choice([0, 1, 2, 3, None]))
                 for i in range(rng.randrange(1, 300))]
        rng.shuffle(cands)
        order = [ReclaimCandidate(*c) for c in sorted(cands, key=SPELLED_OUT[name])]
        assert [c[0] for c in policy.order(cands)] == [c.req_id for c in order]
        total = sum(c[3] or 0 for c in cands)
        for deficit in {1, total // 3, total // 2, total}:
            victims = select_victims(policy, cands, deficit)
            if deficit <= 0:
                assert victims == []
            elif total == 0:
                assert victims is None
            else:
                verify_eq4(order, victims, deficit)
        assert select_victims(policy, cands, total + 1) is None
