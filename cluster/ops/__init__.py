"""Operations: what operators see and what resizes the fleet. Prometheus metrics (`metrics`),
OpenTelemetry traces (`tracing`), every node's status (`node_status`, the source of /status,
`baton status` via `status_view`, and the per-node families), the /dashboard page
(`static/dashboard.html`) and the planner with its KubeRay scaler (`planner`, `planner_k8s`).
It observes the rest through values and protocols: it may import the engine layers and
`cluster.errors`, nothing of the edge, the fleet, placement or membership."""
