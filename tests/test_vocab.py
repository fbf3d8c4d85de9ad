"""The shared vocabulary (kvbench.vocab) and number formatting (kvbench.fmt): one reading of a record's setting
everywhere, one order of settings, one interval form."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from kvbench import fmt, vocab
from kvbench.selection import with_setting


@pytest.mark.parametrize("flag, setting", [
    (True, vocab.QUERY_AWARE), (False, vocab.QUERY_AGNOSTIC), (None, vocab.QUERY_AWARE),
    (math.nan, vocab.QUERY_AWARE), (pd.NA, vocab.QUERY_AWARE), ("false", vocab.QUERY_AGNOSTIC),
    (" No ", vocab.QUERY_AGNOSTIC), ("0", vocab.QUERY_AGNOSTIC), ("true", vocab.QUERY_AWARE), (0, vocab.QUERY_AGNOSTIC),
])
def test_one_reading_of_query_aware(flag, setting):
    assert vocab.setting_of(flag) == setting
    records = pd.DataFrame({"query_aware": [flag]}, dtype=object)
    # The summary (report.summarize reads vocab.settings) and the selection agree, text "false" included.
    assert vocab.settings(records).tolist() == [setting]
    assert with_setting(records)["setting"].tolist() == [setting]


def test_records_without_the_flag_are_query_aware():
    assert vocab.settings(pd.DataFrame({"x": [1, 2]})).tolist() == [vocab.QUERY_AWARE] * 2


def test_settings_are_ordered_known_first_then_sorted():
    assert vocab.ordered_settings(["z", vocab.QUERY_AGNOSTIC, None, "a", vocab.QUERY_AWARE, "z"]) == [
        vocab.QUERY_AWARE, vocab.QUERY_AGNOSTIC, "a", "z"]
    frame = pd.DataFrame({"setting": [vocab.QUERY_AWARE, vocab.QUERY_AGNOSTIC], "v": [1, 2]})
    assert vocab.in_setting(frame, vocab.QUERY_AGNOSTIC)["v"].tolist() == [2]
    assert vocab.in_setting(frame, None) is frame and vocab.in_setting(frame[["v"]], "x")["v"].tolist() == [1, 2]


def test_each_setting_text_names_its_flag():
    for setting in vocab.SETTINGS:
        for text in (vocab.SETTING_TEXT[setting], vocab.SETTING_SENTENCE[setting]):
            assert vocab.SETTING_MEANING[setting] in text and vocab.SETTING_FLAG[setting] in text


def test_sample_depth():
    assert vocab.sample_depth('{"needle_depth": 0.5}') == 0.5
    assert math.isnan(vocab.sample_depth(None)) and math.isnan(vocab.sample_depth({"depths": []}))


def test_numbers_and_intervals():
    assert fmt.number(float("nan"), ".2f") == fmt.MISSING and fmt.number(None, ".2f", "-") == "-"
    assert fmt.number(1.234, ".2f") == "1.23"
    assert fmt.interval(-25.0, -50.0, 0.0) == "-25.0 [-50.0, +0.0]"
    assert fmt.interval(0.0, math.nan, math.nan, missing="-") == "+0.0 [-, -]"
    assert fmt.interval(-0.5, -1.5, 0.5, unit=" pp", label="95% CI ") == "-0.5 pp [95% CI -1.5, +0.5]"
    assert fmt.delta_interval(-7.7, -23.9, 6.8) == "-7.7 [-23.9, +6.8]"
    assert fmt.delta_interval(-7.7, math.nan, 6.8) == "-7.7" and fmt.delta_interval(None, 1, 2) == fmt.MISSING
