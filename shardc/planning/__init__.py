"""Choosing a mesh: the planner, its cost and memory models, and the FLOP counts that
throughput figures use. Compiles candidate programs offline (``shardc.program.offline``)."""
