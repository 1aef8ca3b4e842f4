"""The model server: the vLLM gRPC engine API over an `Engine` backend (the simulator by
default)."""
