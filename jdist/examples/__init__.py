"""Small models and data used by the demo, tutorials, tests and benchmarks."""
