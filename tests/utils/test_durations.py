"""Durations as users write them (train.max_wall_time)."""

from __future__ import annotations

import pytest

from utils.durations import parse_duration


def test_durations_as_users_write_them():
    assert parse_duration("8h30m") == 30600 and parse_duration("45m") == 2700 and parse_duration("90s") == 90
    assert parse_duration("1h5m30s") == 3930 and parse_duration("12.5") == 12.5
    with pytest.raises(ValueError, match="train.max_wall_time: '8x' is not a duration"):
        parse_duration("8x")
