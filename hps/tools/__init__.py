"""Tools off the serving path: the `hps` command (cli/), benchmarks (bench/), the demo."""
