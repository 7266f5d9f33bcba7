"""Where an op is issued and waited on: the watched backend's wiring (every op on a watched
group, or the private one fastdist's own ops on a group torch made go through), and where a fault
becomes an error (fastdist.ops.fault)."""
