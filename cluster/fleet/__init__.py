"""The fleet: the workers on Ray and the gateway's side of them. The Ray actors (`prefill_actor`,
`decode_actor`, `actors`) and their registration in membership (`registration`), how they are
started (`launch`, `ray_runtime`), the handles and values that cross the gateway <-> actor
boundary (`workers`, `worker_msgs`, `output_feed`), the request flow across them (`front`:
RayFront; `pd`: the in-process prefill/decode pair) and its transfer metrics. It may import the
engine and role layers, `cluster.errors`, `cluster.disagg_config`, `cluster.membership`,
`cluster.placement`, `cluster.ops` and the value types of `cluster.edge.frontend` that its fronts
return."""
