"""What a newcomer meets in the first hour of `hps`, run as a user runs it (subprocesses):
a misspelt key stops the run, a lookup writes no store unasked, nothing slow is silent,
every printed hint works, every help names every choice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.tools.test_cli import hps, write_config


@pytest.mark.parametrize("command", [["load"], ["lookup", "-m", "m", "--", "1"]])
def test_a_misspelt_key_stops_the_command_before_anything_loads(
        two_tables: dict[str, Any], command: list[str]) -> None:
    model = two_tables["config"]["models"][0]
    model["embeding_table_names"] = model.pop("embedding_table_names", ["a", "b"])
    config = write_config(two_tables)
    result = hps(command[0], str(config), *command[1:])
    assert result.returncode == 2, result.stderr
    assert ("'models[0].embeding_table_names' is not a config key: did you mean "
            "'models[0].embedding_table_names'?") in " ".join(result.stderr.split())
    assert not (two_tables["dir"] / "rocks").exists()  # nothing was opened nor loaded
