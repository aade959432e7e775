"""kvtier cache service: a standalone server owning the tiers, shared by every engine on a machine."""
