"""Placement: where a request goes. The cluster-wide index of which worker holds which prefix in
which tier (`global_index`, fed by each worker's KV event log, `kv_log`), prefix matching
(`prefix_match`), the measured cost of each link (`links`), which pairs can move pages
(`pair_health`) and the cost model that picks a (prefill, decode) pair (`policy`). It may import
the engine layers, `kvcache` and `cluster.errors`, nothing else of `cluster`."""
