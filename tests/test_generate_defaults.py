"""``pagedkv generate`` samples with settings that do not loop by default, and passes the new options on."""

from __future__ import annotations

from pagedkv_rs.cli.generate import build_parser


def test_defaults_are_not_greedy_without_a_penalty():
    a = build_parser().parse_args(["hi"])
    assert (a.temperature, a.top_p, a.repetition_penalty, a.min_p, a.stop) == (0.2, 0.9, 1.1, 0.0, None)


def test_sampling_options_parse():
    a = build_parser().parse_args(
        ["hi", "--temperature", "0", "--repetition-penalty", "1", "--stop", "\n", "--stop", "END", "--min-p", "0.05"]
    )
    assert (a.temperature, a.repetition_penalty, a.stop, a.min_p) == (0.0, 1.0, ["\n", "END"], 0.05)
