"""The `validation` section of a config: the load gate's limits.

It sits at the top of a config (every model's default) and in a model block (that
model's own); a model's section overrides only the keys it sets (`effective`). The
defaults refuse NaN/infinity and wrong widths (always refused) and only warn on drift:

    validation:
      max_nan_rows: 0          rows holding NaN or infinity a version may have
      duplicates: last         last | first | refuse: which row of a repeated key serves
      drift: warn              warn | refuse: what a drift past its limit does
      max_norm_ratio: 2.0      new/old (or old/new) row-norm mean, p50, p99 on shared keys
      max_key_churn: 0.5       share of the served keys removed, or of the new ones added
      drift_sample_keys: 10000 keys sampled (by hash) to measure the drift
      min_key_ratio: 0.5       least share of the served version's keys a reload holds
      allow_empty: false       true: a table of no keys loads (it serves defaults only)
      allow_shrink: false      true: a reload under min_key_ratio loads

A load's caller may add `allow_empty` and `allow_shrink` for that load alone
(`with_opt_ins`: the reload route's body, `reload_model(..., allow_empty=True)`).

Unknown keys in the section are refused with the nearest known one named: a limit
misspelt would otherwise pass silently.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from hps.errors import ConfigError
from hps.runtime.strict_scalars import StrictSection


class ValidationConfig(StrictSection):
    """`validation`: what a load or reload must pass before its version serves."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    #: rows with NaN or infinity a version may hold (they load as they are); more refuse
    #: it. `allow_non_finite_vectors: true` lifts the limit.
    max_nan_rows: int = Field(0, ge=0)
    #: "last": the last row of a repeated key serves (HugeCTR's tiers do the same);
    #: "first": the first row serves, later ones are dropped while streaming;
    #: "refuse": a version whose files repeat a key is refused
    duplicates: Literal["last", "first", "refuse"] = "last"
    #: "warn": a drift past a limit is logged, counted and reported, the version serves;
    #: "refuse": it is not swapped in
    drift: Literal["warn", "refuse"] = "warn"
    #: largest ratio (either way) of the new version's row-norm mean, p50 or p99 to the
    #: served one's, on the sampled keys both hold
    max_norm_ratio: float = Field(2.0, ge=1.0)
    #: largest share of the served keys the new version drops, or of its keys it adds
    max_key_churn: float = Field(0.5, ge=0.0, le=1.0)
    #: keys sampled (chosen by a hash of the key, so two versions sample alike)
    drift_sample_keys: int = Field(10_000, ge=1, le=1_000_000)
    #: least share of the served version's distinct keys a reload must hold: a version
    #: far smaller would answer the default vector for the keys it lost (0: no limit)
    min_key_ratio: float = Field(0.5, ge=0.0, le=1.0)
    #: a table of no keys loads (first loads too): every lookup of it gets the default
    #: vector, so it is refused unless asked for
    allow_empty: bool = False
    #: a reload holding fewer than `min_key_ratio` of the served keys loads; the key
    #: churn its lost keys make only warns
    allow_shrink: bool = False

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in data:
                if key not in cls.model_fields:
                    near = difflib.get_close_matches(str(key), cls.model_fields, n=1)
                    hint = f" (did you mean '{near[0]}'?)" if near else (
                        f" (known: {', '.join(cls.model_fields)})")
                    raise ValueError(f"unknown key {key!r} in validation{hint}")
        return data


#: the keys a load's caller may set for that load alone, over its config's section
OPT_INS = ("allow_empty", "allow_shrink")


def requested_opt_ins(allow_empty: bool, allow_shrink: bool) -> tuple[str, ...]:
    """The opt-ins a load's flags ask for."""
    return tuple(k for k, v in zip(OPT_INS, (allow_empty, allow_shrink), strict=True) if v)


def with_opt_ins(settings: ValidationConfig, opt_ins: Collection[str]) -> ValidationConfig:
    """`settings` with the `opt_ins` (names of OPT_INS) set for one load; ConfigError for
    another name."""
    unknown = sorted(set(opt_ins) - set(OPT_INS))
    if unknown:
        raise ConfigError(f"unknown opt-in(s) {', '.join(unknown)} (known: {', '.join(OPT_INS)})")
    if not opt_ins:
        return settings
    return settings.model_copy(update=dict.fromkeys(opt_ins, True))


def effective(server: ValidationConfig, model: ValidationConfig | None) -> ValidationConfig:
    """The limits a model's load runs under: the server-wide section with the keys the
    model's own section sets put over it."""
    if model is None:
        return server
    return server.model_copy(update={k: getattr(model, k) for k in model.model_fields_set})
