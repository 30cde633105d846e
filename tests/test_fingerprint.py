"""The state fingerprint is exact: equal bytes agree, one ulp anywhere differs, every dtype works."""

from __future__ import annotations

import torch

from checkmate.fingerprint import checksum, fingerprint, mismatches


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
    assert checksum(torch.tensor([True, False, True])) == 2
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
