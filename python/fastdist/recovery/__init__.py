"""Recovering in place: the ranks agree on a new generation, rebuild the group, reset DDP and
FSDP2, and hand a joining rank the live ranks' state."""
