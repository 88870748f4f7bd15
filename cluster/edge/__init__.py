"""The edge: what clients call. The OpenAI-compatible HTTP API (`http_api`, its schema and
rendering), the `baton.v1.GenerationService` gRPC service (`grpc_api`: its fields `grpc_fields`, its replies
`grpc_output`, its server with health and reflection `grpc_server`, external pools `grpc_gateway`), the
Frontend both share (`frontend`: validation, admission, tenants, tool calls, structured-output
fields) and the middleware in front of them (`guard`: API keys, body limit). It reaches the engine side only
through the protocols `frontend` defines, never by importing a fleet module; it may import the
engine layers, `cluster.errors`, `cluster.ops` (metrics, traces, node status) and
`cluster.placement` (pair health for /status)."""
