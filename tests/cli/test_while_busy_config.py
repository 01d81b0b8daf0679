"""Where ``whileBusy`` is set: ``yoke agent create`` and ``yoke join --while-busy``, or the join's
configuration file; the join's wins over the agent's, and ``queue`` is the default."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from yoke.cli.base import UsageError
from yoke.cli.main import join_config_of, parser
from yoke.core.models import Actor
from yoke.runtime.instances import ProcessorConfig
from yoke.runtime.joins import agent_while_busy


def processor_config(while_busy: str = "queue") -> ProcessorConfig:
    return ProcessorConfig.model_validate(
        {
            "sourceConversationId": "f",
            "forumParticipantId": "p",
            "agentActorId": "a",
            "monologueId": "m",
            "agentParticipantId": "q",
            "whileBusy": while_busy,
        }
    )


def test_join_takes_while_busy_from_its_flag_over_the_file(tmp_path: Path) -> None:
    file = tmp_path / "join.json"
    file.write_text(json.dumps({"whileBusy": "interrupt", "hopCap": 2}))
    base = ["join", "--agent", "A", "--forum", "F"]
    assert join_config_of(parser().parse_args(base)).while_busy is None
    assert join_config_of(parser().parse_args([*base, "--config", str(file)])).while_busy == (
        "interrupt"
    )
    args = parser().parse_args([*base, "--config", str(file), "--while-busy", "coalesce"])
    config = join_config_of(args)
    assert (config.while_busy, config.hop_cap) == ("coalesce", 2)
    assert config.to_wire()["whileBusy"] == "coalesce"


def test_an_unknown_mode_is_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(["join", "--agent", "A", "--forum", "F", "--while-busy", "later"])
    assert exit_.value.code == 2 and "--while-busy" in capsys.readouterr().err
    file = tmp_path / "join.json"
    file.write_text(json.dumps({"whileBusy": "sometimes"}))
    args = parser().parse_args(["join", "--agent", "A", "--forum", "F", "--config", str(file)])
    with pytest.raises(UsageError, match="whileBusy"):
        join_config_of(args)


def test_the_agents_default_applies_unless_the_join_sets_one() -> None:
    args = parser().parse_args(["agent", "create", "--name", "n", "--while-busy", "interrupt"])
    assert args.while_busy == "interrupt"
    agent = Actor(id="a", kind="agent", name="n", meta={"whileBusy": "interrupt"})
    assert agent_while_busy(agent) == "interrupt"
    assert agent_while_busy(Actor(id="b", kind="agent", name="n")) == "queue"
    defaults = processor_config(agent_while_busy(agent))
    assert defaults.with_join(None).while_busy == "interrupt"
    join = join_config_of(
        parser().parse_args(["join", "--agent", "A", "--forum", "F", "--while-busy", "coalesce"])
    )
    assert defaults.with_join(join).while_busy == "coalesce"
    assert processor_config().while_busy == "queue"
