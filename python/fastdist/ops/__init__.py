"""Where an op is issued and waited on: the watched backend's wiring (every op on a watched
group), the fallback for groups fastdist does not watch, and NCCL's polled completion."""
