"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over an engine thread."""
