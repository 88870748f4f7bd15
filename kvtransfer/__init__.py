"""Moving KV pages between workers: page codec, reservations, local and gRPC transports."""
