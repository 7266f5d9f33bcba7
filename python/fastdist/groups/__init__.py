"""Process groups as fastdist sees them: their state (generation, dead or alive), the registry of
watched groups and their op history, and the cross-rank checks."""
