"""agentkv.benchmarks: reproducible measurements; results under benchmarks/results/."""
