"""The database tiers: one contract (`base.Tier`), opened from a config by `open_tiers`."""

from hps.tiers.open import Tiers, open_tiers

__all__ = ["Tiers", "open_tiers"]
