"""The `ds4mlx` command line: the dispatcher (commands.py), generate / chat and its REPL,
directional steering, and the flags several commands share."""
