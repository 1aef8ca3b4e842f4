"""The endpoint picker (EPP): an Envoy ext_proc server that picks a model-server replica per
request."""
