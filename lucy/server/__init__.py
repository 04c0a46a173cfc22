"""``lucy serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over poly.serving.

Needs the ``serve`` extra (``pip install 'polyloom[serve]'``). See docs/serve.md.
"""
