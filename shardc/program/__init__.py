"""Building and running a rank's program: the compiled module (``ShardedModule``), the
build that runs the passes (``build.py``), the checks on user input, the agreement between
ranks, the inductor backend, and the program's readouts (``explain``, the comm report).
Above ``passes`` and ``runtime``; below planning, training utilities and the public API."""
