"""Commands: ``fastdist`` (cli), ``fastdist run`` (a torchrun that replaces a dead worker),
``fastdist doctor`` and ``fastdist demo``."""
