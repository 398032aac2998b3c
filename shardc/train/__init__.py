"""Training utilities around a compiled module: global gradient clipping and the
non-finite step guard. (Checkpoints are ``shardc.checkpoint``, a public module.)"""
