"""``tqexport serve``: an OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn)."""

from tqexport.serve.app import create_app
from tqexport.serve.runner import serve

__all__ = ["create_app", "serve"]
