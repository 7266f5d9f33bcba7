"""What a fault means and who is missing, read and reported: the listener that answers a peer's
fault (it asks fastdist.ops.fault to apply it), the verdict on a backend's error, the stacks, the
events and the fault dumps. The board and the ring, the store protocols they read, are
fastdist.store's."""
