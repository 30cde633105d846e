"""The state fingerprint is exact: equal bytes agree, one ulp anywhere differs, every dtype works."""

from __future__ import annotations

import torch

from checkmate.fingerprint import (
    ChecksumCache,
    FingerprintTurns,
    checksum,
    checksums,
    fingerprint,
    mismatches,
)


def test_one_ulp_anywhere_changes_the_checksum_and_equal_bytes_agree() -> None:
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        a = torch.randn(257, generator=generator).to(dtype)
        assert checksum(a) == checksum(a.clone()) == checksum(a.reshape(1, 257).t().contiguous())
        for index in (0, 128, 256):
            b = a.clone()
            b[index] = torch.nextafter(b[index : index + 1], torch.tensor([10.0], dtype=dtype))[0]
            assert checksum(b) != checksum(a), (dtype, index)
    assert checksum(torch.tensor(3.0)) == 0x40400000  # a 0-d step: its bit pattern
    assert checksum(torch.tensor([True, False, True])) == 0x010001  # bytes 01 00 01 as a little-endian word
    assert checksum(torch.full((3,), -1, dtype=torch.int64)) == (3 * (2**64 - 1)) % 2**64  # wraps mod 2**64
    assert checksum(torch.arange(4, dtype=torch.int64)) == 6
    strided = torch.arange(12.0).reshape(3, 4).t()  # not contiguous: same as its contiguous copy
    assert checksum(strided) == checksum(strided.contiguous())


def test_fingerprints_compare_names_in_both_and_flag_state_keys_on_one_side() -> None:
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.zeros(2))
    state = {p: {"step": torch.tensor(2.0), "exp_avg": torch.ones(3)}}
    mine = fingerprint([("p", p), ("q", q)], state)
    assert mismatches(mine, mine) == []
    theirs = fingerprint([("p", p)], {p: {"step": torch.tensor(2.0), "exp_avg": torch.ones(3) * 2}})
    assert mismatches(mine, theirs) == ["p::exp_avg"]  # q is not theirs: not compared
    fewer = fingerprint([("p", p)], {p: {"step": torch.tensor(2.0)}})
    assert mismatches(mine, fewer) == ["p::exp_avg"]


def test_checksums_of_many_tensors_at_once_equal_each_one_alone() -> None:
    generator = torch.Generator().manual_seed(1)
    tensors = [
        torch.randn(5, generator=generator),  # 20 bytes: padded to 24 in the joined buffer
        torch.empty(0),  # nothing: 0, and no segment of its own
        torch.randn(3, generator=generator).to(torch.bfloat16),  # 6 bytes
        torch.tensor(7.0),  # 0-d
        torch.tensor([True, False, True]),
        torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        torch.full((2,), -1, dtype=torch.int64),
    ]
    alone = [checksum(t) for t in tensors]
    assert checksums(tensors) == alone
    assert alone[1] == 0 and alone[3] == 0x40E00000 and alone[6] == (2 * (2**64 - 1)) % 2**64
    # padding never leaks between neighbours: a change in one tensor changes only its own checksum
    changed = [t.clone() for t in tensors]
    changed[0][4] = torch.nextafter(changed[0][4:5], torch.tensor([10.0]))[0]
    after = checksums(changed)
    assert after[0] != alone[0] and after[1:] == alone[1:]


def test_checksum_cache_equals_the_reference_as_tensors_change_move_and_go() -> None:
    from checkmate.fingerprint import ChecksumCache, cache_for, checksums

    cache = ChecksumCache()
    tensors = [
        torch.randn(1000),
        torch.randn(7).to(torch.bfloat16),  # a partial last word
        torch.zeros(3, dtype=torch.uint8),
        torch.randn(4, 4).t(),  # not contiguous: not cached, still right
        torch.tensor(2.5),  # 0-d
    ]
    assert cache.checksums(tensors) == checksums(tensors)
    tensors[0].add_(1.0)  # changed in place: the cached view sees it
    tensors[1][3] = 7.0
    assert cache.checksums(tensors) == checksums(tensors)
    tensors[0].data = torch.randn(999)  # new memory under the same tensor object
    assert cache.checksums(tensors) == checksums(tensors)
    tensors[2] = torch.ones(5, dtype=torch.uint8)  # another tensor in that place
    assert cache.checksums(tensors) == checksums(tensors)
    assert cache.checksums(tensors[:2]) == checksums(tensors[:2])  # the others are forgotten
    owner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert cache_for(owner) is cache_for(owner)


def test_turns_cut_the_parameters_in_order_within_the_budget_and_cover_each_once_per_round() -> None:
    sizes = [("a", 10), ("b", 30), ("c", 25), ("huge", 100), ("d", 5), ("e", 5)]
    turns = FingerprintTurns(sizes, budget=40)
    assert turns.groups == (
        frozenset({"a", "b"}),
        frozenset({"c"}),
        frozenset({"huge"}),  # larger than the budget: a group of its own
        frozenset({"d", "e"}),
    )
    assert not turns.whole
    assert [turns.names(t) for t in (0, 4, 5)] == [frozenset({"a", "b"})] * 2 + [frozenset({"c"})]
    covered = [name for t in range(len(turns.groups)) for name in sorted(turns.names(t) or ())]
    assert sorted(covered) == sorted(name for name, _ in sizes)  # every parameter, once per round
    # within the budget, or no budget: the whole state every time
    assert FingerprintTurns(sizes, budget=175).whole and FingerprintTurns(sizes, budget=175).names(3) is None
    assert FingerprintTurns(sizes, budget=0).names(7) is None
    params = [("w", torch.zeros(4, 4)), ("b", torch.zeros(4)), ("v", torch.zeros(8, dtype=torch.float64))]
    assert FingerprintTurns.of(params, budget=64).groups == (
        frozenset({"w"}),
        frozenset({"b"}),
        frozenset({"v"}),
    )


def test_a_turn_fingerprints_only_its_parameters_and_the_comparison_sees_a_divergence_in_its_turn() -> None:
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.zeros(2))
    state = {p: {"exp_avg": torch.ones(3)}, q: {"exp_avg": torch.zeros(2)}}
    turns = FingerprintTurns.of([("p", p), ("q", q)], budget=12)
    assert turns.groups == (frozenset({"p"}), frozenset({"q"}))
    cache = ChecksumCache()
    sent = [fingerprint([("p", p), ("q", q)], state, cache, turns.names(t), keep=2) for t in range(2)]
    assert [set(f) for f in sent] == [{"p"}, {"q"}]
    full = fingerprint([("p", p), ("q", q)], state)
    assert sent[0]["p"] == full["p"] and sent[1]["q"] == full["q"]
    state[q]["exp_avg"][1] = 1e-30  # the shadow's q diverged
    shadow = fingerprint([("p", p), ("q", q)], state)
    assert mismatches(sent[0], shadow) == []  # not q's turn: not seen yet
    assert mismatches(sent[1], shadow) == ["q::exp_avg"]  # its turn: seen


def test_the_cache_keeps_the_views_of_the_last_keep_calls_and_releases_older_ones() -> None:
    a, b = torch.arange(6.0), torch.arange(5.0)
    cache = ChecksumCache()
    assert cache.checksums([a], keep=2) == checksums([a])
    assert cache.checksums([b], keep=2) == checksums([b])
    assert {id(a), id(b)} <= cache.cached_ids()  # a's view kept across one call of other tensors
    a += 1  # in place: the same memory, a new value, still exact
    assert cache.checksums([a], keep=2) == checksums([a])
    cache.checksums([b], keep=1)
    assert cache.cached_ids() == {id(b)}  # with keep=1 only the last call's tensors stay
