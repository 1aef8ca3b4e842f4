"""OpenAI API over HTTP in, vLLM gRPC engine API out (see kvswitch.frontend.app)."""
