"""The OpenAI-compatible HTTP server (`kvserve serve`): FastAPI + uvicorn over AsyncEngine."""
