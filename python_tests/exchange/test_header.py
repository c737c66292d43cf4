"""exchange/header.py: the per-rank step header (flags word, step word) and the decision every
rank takes from the gathered headers."""

import pytest
import torch

import dlion_kernels as dk
from dlion_kernels.exchange.header import (
    HEADER_WORDS,
    NONFINITE,
    SETTINGS_SHIFT,
    SettingsMismatchError,
    StepMismatchError,
    decide,
    make_header,
    settings_differ,
    settings_digest,
    settings_word,
)
from dlion_kernels.exchange.pipeline import ABORTED, Segment


def _flag(value):
    return torch.tensor([value], dtype=torch.int32)


def test_layout():
    assert HEADER_WORDS == 2 and NONFINITE == 1
    assert dk.StepMismatchError is StepMismatchError
    assert issubclass(StepMismatchError, RuntimeError)


@pytest.mark.parametrize("flag, word0", [(0, 0), (1, 1), (5, 1), (-1, 1), (2**31 - 1, 1)])
def test_make_header_flags_any_nonzero_value(flag, word0):
    header = make_header(_flag(flag), 3)
    assert header.dtype == torch.int32 and header.shape == (HEADER_WORDS,)
    assert header.tolist() == [word0, 3]


@pytest.mark.parametrize("step, word1", [(0, 0), (1, 1), (2**31 - 1, 2**31 - 1), (2**31, 0),
                                         (2**31 + 7, 7), (5 * 2**31 + 9, 9)])
def test_make_header_step_modulo_2_31(step, word1):
    assert make_header(_flag(0), step).tolist() == [0, word1]


def test_make_header_on_the_flags_device_and_leaves_the_flag_alone():
    flag = _flag(3)
    header = make_header(flag, 4)
    assert header.device == flag.device
    assert flag.tolist() == [3]
    assert header.untyped_storage().data_ptr() != flag.untyped_storage().data_ptr()


def _gathered(*rows):
    return torch.tensor(rows, dtype=torch.int32)


def test_decide_same_step():
    assert decide(_gathered([0, 5])) is False  # one rank
    assert decide(_gathered([0, 5], [0, 5], [0, 5])) is False
    assert decide(_gathered([0, 5], [NONFINITE, 5], [0, 5])) is True
    assert decide(_gathered([NONFINITE, 5], [NONFINITE, 5])) is True


def test_decide_reads_only_the_nonfinite_bit():
    assert decide(_gathered([2, 5], [0, 5])) is False  # bit 1 (gave up): Exchange.explain's
    assert decide(_gathered([2, 5], [3, 5])) is True


def test_decide_takes_the_flat_all_gather_output():
    """all_gather_into_tensor gives one flat int32 tensor of n * HEADER_WORDS words."""
    headers = torch.cat([make_header(_flag(0), 9), make_header(_flag(1), 9)])
    assert headers.shape == (2 * HEADER_WORDS,)
    assert decide(headers) is True


def test_decide_raises_on_different_steps_naming_them():
    headers = _gathered([0, 4], [0, 4], [NONFINITE, 3], [0, 5])
    with pytest.raises(StepMismatchError) as info:
        decide(headers)
    message = str(info.value)
    assert "rank 0 is at step 4, rank 2 at step 3" in message
    assert "(all steps: [4, 4, 3, 5])" in message
    assert "nothing was updated on any rank" in message
    assert headers.tolist() == [[0, 4], [0, 4], [NONFINITE, 3], [0, 5]]


def test_decide_step_mismatch_wins_over_a_flag():
    """Ranks on different steps raise even when one flags a non-finite gradient (a skip would
    let their collectives pair different steps)."""
    with pytest.raises(StepMismatchError, match="rank 1 at step 8"):
        decide(_gathered([NONFINITE, 7], [0, 8]))


def test_steps_that_differ_by_2_31_look_equal():
    """The step word is the step modulo 2**31: documented, not detected."""
    headers = torch.stack([make_header(_flag(0), 3), make_header(_flag(0), 3 + 2**31)])
    assert decide(headers) is False


def _segments(lr=1e-2, betas=(0.9, 0.99), wd=0.0, groups=2):
    return [Segment([], [], [], lr, betas[0], betas[1], wd) for _ in range(groups)]


def test_settings_digest_in_word_zero():
    """Word 0 carries a 29-bit digest of every param group's settings above the two flag bits:
    any one setting changed gives another digest; the flags stay readable; None gives 0."""
    base = settings_digest(_segments())
    assert 0 <= base < 2**29 and settings_digest(None) == 0
    for other in (_segments(lr=0.5), _segments(betas=(0.9, 0.5)), _segments(wd=0.3),
                  _segments(groups=1)):
        assert settings_digest(other) != base
    word = settings_word(ABORTED, _segments())
    assert word & ABORTED and not word & NONFINITE and word >> SETTINGS_SHIFT == base
    header = make_header(_flag(1), 7, settings_word(0, _segments()))
    assert header.tolist() == [NONFINITE | base << SETTINGS_SHIFT, 7]
    assert 0 <= int(header[0]) < 2**31  # a non-negative int32


def test_settings_that_differ_raise_the_same_error():
    same = torch.stack([make_header(_flag(0), 3, settings_word(0, _segments()))] * 3)
    assert not decide(same) and not bool(settings_differ(same[:, 0]))
    odd = same.clone()
    odd[2, 0] = settings_word(0, _segments(lr=0.5))
    assert bool(settings_differ(odd[:, 0]))
    with pytest.raises(SettingsMismatchError, match=r"ranks \[2\].*nothing was updated"):
        decide(odd)
    assert issubclass(SettingsMismatchError, ValueError)
