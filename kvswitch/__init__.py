"""kvswitch: an inference gateway for model servers that speak the vLLM gRPC engine API."""

from __future__ import annotations

__all__ = ["__version__"]
__version__ = "0.1.0"
