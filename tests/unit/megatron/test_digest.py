"""The master digest's fingerprint of a tensor (`fp4_dist.megatron.parity.fingerprint`): equal for equal bits, and
changed by any change of one word or by words that trade places, on the CPU (the bytes themselves) and on a GPU
(sums computed there)."""

from __future__ import annotations

import pytest
import torch

from fp4_dist.megatron.parity import _CHUNK, fingerprint

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_equal_bits_give_equal_fingerprints_and_any_change_of_a_word_or_an_order_another(device):
    torch.manual_seed(0)
    x = torch.randn(3, _CHUNK // 2 + 1001, device=device) if device == "cuda" else torch.randn(37, 1001)
    want = fingerprint(x)
    assert fingerprint(x.clone()) == want and fingerprint(x.t().contiguous().t()) == want  # layout is not content
    flat = x.reshape(-1)
    for i in (0, 17, flat.numel() // 2, flat.numel() - 1):  # on a GPU: in the first and the second chunk of words
        for change in ("lowest bit", "sign", "swap"):
            y = flat.clone()
            if change == "lowest bit":
                y.view(torch.int32)[i] ^= 1
            elif change == "sign":
                y[i] = -y[i]
            else:
                y[[i, i - 1]] = y[[i - 1, i]]
            assert fingerprint(y.view(x.shape)) != want, (i, change)
    assert fingerprint(x.reshape(-1)) != want  # the shape is part of it
    assert fingerprint(torch.zeros(0, 4, device=device)) != fingerprint(torch.zeros(4, 0, device=device))
