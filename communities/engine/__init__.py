"""The per-rank engine: the loop (``loop.py``) and its parts, each owning its state."""
