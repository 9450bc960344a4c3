"""The OpenAI-compatible HTTP server: ``build_app`` (FastAPI) and ``serve`` (uvicorn with a graceful drain)."""

from pagedkv_rs.serve.app import build_app
from pagedkv_rs.serve.server import Server, serve

__all__ = ["build_app", "serve", "Server"]
