"""The database tiers: one contract (`base.Tier`), opened from a config by `open_tiers`."""

from hps.db.tiers import Tiers, open_tiers

__all__ = ["Tiers", "open_tiers"]
