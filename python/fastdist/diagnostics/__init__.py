"""What a fault means and who is missing: the group's board and report, the ring that tells every
rank, the listener that answers it, the verdict on a backend's error, and the fault dumps."""
