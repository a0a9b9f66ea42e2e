"""Benchmarks: the frontier prefill/decode bench, the decode profile, the kernel bench, and the
random full-size models they run on."""
