"""kvops benchmarks: `python -m benchmarks [--quick] [--csv out.csv] [--plot out.png]`."""
