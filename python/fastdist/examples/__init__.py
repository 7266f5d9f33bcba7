"""Example training scripts (run with fastdist run -m fastdist.examples.NAME)."""
