"""Reliability drills: each starts real processes on 127.0.0.1, provokes one kind of
failure, and returns a `DrillResult` of pass/fail checks and figures. `benchmarks/drills.py`
runs them from the command line; `tests/drills/` runs their quick versions in `make test`."""
