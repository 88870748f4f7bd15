"""The cluster simulator behind `baton sim` (BENCHMARKS.md P11): baton's real Placer and
GlobalIndex placing requests on simulated prefill and decode workers, in virtual time, next to
other routing policies. It owns the simulated parts (calibration, cache, workers, traffic,
policies, the event loop, the report) and imports the real placement from cluster/ and the
workloads from bench/; nothing outside bench/sim/ imports it but its command and its tests.
"""
