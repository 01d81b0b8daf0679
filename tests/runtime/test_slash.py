"""The one rule for what a slash command is (yoke.core.slash), as every reader of a line uses it."""

from __future__ import annotations

import pytest

from yoke.client import STOP_LINE
from yoke.core.slash import SlashCommand, is_stop, slash_command


@pytest.mark.parametrize(
    ("text", "command"),
    [
        ("/stop", SlashCommand("/stop", "")),
        ("  /stop  ", SlashCommand("/stop", "")),
        ("/STOP", SlashCommand("/stop", "")),
        ("\t/Stop now\n", SlashCommand("/stop", "now")),
        ("/model  gpt-Big ", SlashCommand("/model", "gpt-Big")),  # the argument keeps its case
        ("/model\tgpt-x", SlashCommand("/model", "gpt-x")),
        ("hello /stop", None),
        ("", None),
        ("   ", None),
    ],
)
def test_a_command_is_its_first_word_in_lower_case_whatever_the_white_space(
    text: str, command: SlashCommand | None
) -> None:
    assert slash_command(text) == command
    assert is_stop(text) == (command is not None and command.name == "/stop")


def test_stop_is_the_line_a_stop_submits() -> None:
    assert is_stop(STOP_LINE)
