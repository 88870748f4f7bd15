"""Generated protobuf / gRPC stubs (proto/generate.py); do not edit."""
