"""The OpenAI-compatible HTTP server: ``build_app`` (FastAPI) and ``serve`` (uvicorn with a graceful drain).

The server's names load on first use, so that the offline API can use ``serve.tools`` (tool rendering and
parsing) without the server's dependencies."""

from typing import Any

__all__ = ["build_app", "serve", "Server"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from pagedkv_rs.serve.app import build_app

        return build_app
    if name in ("serve", "Server"):
        from pagedkv_rs.serve import server

        return getattr(server, name)
    raise AttributeError(f"module 'pagedkv_rs.serve' has no attribute {name!r}")
