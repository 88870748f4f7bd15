"""The gateway over many engines: pools of endpoints (this gateway's own workers and external
OpenAI-compatible engines, `config`), the per-route-key prefix-overlap measure (`overlap`), the
index of which endpoint holds which prefix (`prefix_index`: approximate from what the gateway
sent, precise from an engine's KV events, `kv_events`), endpoint health and ejection
(`endpoints`), the routing decision (`router`), the proxy (`proxy`, and `http_routing` in front
of the OpenAI API), the request log `baton analyze-prefix` reads (`route_log`) and the metrics
(`metrics`). It may import the engine layers, `kvcache`, `cluster.errors`, `cluster.ops` and
`cluster.placement`; the edge imports it, never the other way round."""
