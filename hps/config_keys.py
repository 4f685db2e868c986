"""Keys of a config that `hps` does not know: a warning, or an error for a misspelling.

HugeCTR's files carry keys `hps` ignores, so an unknown key is an
`UnknownConfigKeyWarning` naming its path and the nearest known key, and the config
loads. One kind is refused instead: a near miss of a known key (the nearest) that the
same mapping does not have (`embeding_table_names` where no `embedding_table_names` is given). That
is a misspelling whose known key would silently take its default (HugeCTR's table
names, here) and fail later, far from the typo: `check_keys` raises one ConfigError
naming every such key beside the key it misses, before anything is warned about or
loaded. Near means difflib's similarity ratio of at least `NEAR_MISS` (one letter
added, dropped or changed in a key of five letters or more); keys HugeCTR's own files
of earlier versions carried (`HUGECTR_KEYS`) stay warnings, however close.

A key of another level is refused the same way: `update_source` inside a model block, or
`gpucache` beside `models`, where the level it belongs to lacks it. It would be ignored
where it stands (HugeCTR ignores it too), and the server would run without what it asks
for (an update source never started: the trainer publishes and nothing changes).

Warnings point at the caller's line, not at this package.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic

from hps.errors import ConfigError
from hps.runtime.caller_line import caller_stacklevel

#: difflib ratio at or above which an unknown key is taken for a misspelt known one
NEAR_MISS = 0.8
#: keys of earlier HugeCTR ps.json files, close to a key of ours but not a misspelling of
#: it (`max_get_batch_size` beside `max_batch_size`): they stay warnings
HUGECTR_KEYS = frozenset({"max_get_batch_size", "max_set_batch_size",
                          "max_receive_buffer_size"})

#: the folders whose frames a config warning skips to reach the caller's line
_INTERNAL = tuple(os.path.dirname(os.path.abspath(f)) + os.sep
                  for f in (__file__, pydantic.__file__))


#: where a key of the other level belongs (`unknown_keys`' `elsewhere`)
AT_TOP = "at the top level (beside \"models\")"
IN_MODELS = "in each model block (\"models\": [{...}])"


class UnknownConfigKeyWarning(UserWarning):
    """A config key that `hps` does not know (often a misspelling); it is ignored."""


@dataclass(frozen=True)
class UnknownKey:
    """A key of the mapping at `path` that is not one of its known keys."""

    path: str  # the mapping's path, with its trailing dot: "models[0]."
    key: str
    near: str | None  # the nearest known key, if any is close
    misspelt: bool  # a near miss of a known key the mapping lacks
    belongs: str | None = None  # a key of another level that lacks it: where it belongs

    @property
    def refused(self) -> bool:
        """Whether the config must not load (a misspelling, or a key out of its place)."""
        return self.misspelt or self.belongs is not None

    def warning(self) -> str:
        hint = (f" (did you mean '{self.near}'?)" if self.near else
                " (docs/configuration.md lists every key)")
        return f"unknown config key '{self.path}{self.key}' is ignored{hint}"

    def error(self) -> str:
        if self.belongs is not None:
            return (f"'{self.path}{self.key}' is ignored here: it is a key {self.belongs}; "
                    "move it there")
        return (f"'{self.path}{self.key}' is not a config key: did you mean "
                f"'{self.path}{self.near}'? (without it, '{self.near}' takes its default)")


def unknown_keys(raw: dict[str, Any], known: Sequence[str], path: str,
                 elsewhere: Mapping[str, str] | None = None) -> list[UnknownKey]:
    """The keys of `raw` not in `known`, each with its nearest known key; `elsewhere`:
    keys of another level that it lacks, each with where it belongs (AT_TOP, IN_MODELS)."""
    found = []
    for key in raw:
        if key in known:
            continue
        name = str(key)
        near = difflib.get_close_matches(name, known, n=1)
        misspelt = bool(near) and near[0] not in raw and name not in HUGECTR_KEYS and \
            difflib.SequenceMatcher(None, name, near[0]).ratio() >= NEAR_MISS
        belongs = (elsewhere or {}).get(name)
        found.append(UnknownKey(path, name, near[0] if near else None,
                                misspelt and belongs is None, belongs))
    return found

def report(found: Iterable[UnknownKey]) -> None:
    """Raise ConfigError naming every misspelt or misplaced key (the config must not
    load), else warn about each unknown key (UnknownConfigKeyWarning, at the caller's
    line)."""
    found = list(found)
    refused = [k.error() for k in found if k.refused]
    if refused:
        raise ConfigError("; ".join(refused))
    for key in found:
        warnings.warn(key.warning(), UnknownConfigKeyWarning,
                      stacklevel=caller_stacklevel(_INTERNAL))
