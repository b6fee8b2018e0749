"""Research tools, not the training system: nothing in the core imports it (tests/test_architecture.py).

The discrete-event model of the pipeline (`simulate`, its command line `simulate_cli`: `tiderl
simulate`, docs/simulate.md), the collapse rule of benchmarks/collapse.py (`collapse`), the
statistics that compare runs (`compare`, docs/metrics.md), launchers for tests and benchmarks:
data-parallel ranks on this machine (`ranks`), a local vLLM server (`vllm_server`), and the core a thread runs on (`cpu`, for
benchmarks/async_vs_sync.py)."""
