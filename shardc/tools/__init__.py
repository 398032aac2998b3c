"""The command line and what it drives: the demo, benchmarks, profiler timelines, the
comm gate, the model zoo and the specs the CLI loads. The top floor: nothing imports it
but ``shardc.__main__``."""
