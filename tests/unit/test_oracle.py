"""The conformance suite's comparison (tests/oracle.py `differences`): what it lets through and
what it catches. A rule that accepted any mismatch would let every conformance test pass."""

from __future__ import annotations

from oracle import Answer, differences


def answer(*steps: tuple[str, dict[str, float]]) -> Answer:
    """Greedy steps as (the token taken, its top logprobs), token ids numbered by their text."""
    return Answer(tuple(int(token) for token, _ in steps), tuple(tops for _, tops in steps), "")


ORACLE = {"p": answer(("1", {"1": -0.5, "2": -1.5}), ("3", {"3": -0.70, "4": -0.72, "5": -3.0}),
                      ("6", {"6": -0.1, "7": -4.0}))}


def test_equal_answers_conform():
    assert differences(ORACLE, ORACLE) == []


def test_the_other_side_of_a_near_tie_ends_the_comparison_without_a_difference():
    ours = {"p": answer(("1", {"1": -0.5, "2": -1.5}), ("4", {"4": -0.70, "3": -0.71}), ("9", {"9": -0.2}))}
    assert differences(ours, ORACLE) == []


def test_a_token_outside_the_near_tie_is_a_difference_even_where_the_oracle_had_one():
    ours = {"p": answer(("1", {"1": -0.5, "2": -1.5}), ("5", {"5": -0.6, "3": -0.9}), ("6", {"6": -0.1}))}
    assert any("token 1 is 5" in line for line in differences(ours, ORACLE))


def test_a_different_token_where_the_oracle_was_sure_is_a_difference():
    ours = {"p": answer(("2", {"2": -0.5, "1": -1.5}), ("3", {"3": -0.7}), ("6", {"6": -0.1}))}
    assert any("token 0 is 2" in line for line in differences(ours, ORACLE))


def test_logprobs_beyond_the_tolerance_are_a_difference():
    ours = {"p": answer(("1", {"1": -0.5, "2": -2.5}), *[(t, tops) for t, tops in zip(("3", "6"),
                        ORACLE["p"].top_logprobs[1:], strict=True)])}
    assert any("top logprobs differ" in line for line in differences(ours, ORACLE))


def test_a_shorter_answer_is_a_difference():
    ours = {"p": answer(("1", {"1": -0.5, "2": -1.5}), ("3", {"3": -0.70, "4": -0.72, "5": -3.0}))}
    assert differences(ours, ORACLE) == ["p: 2 tokens, vLLM gave 3"]
