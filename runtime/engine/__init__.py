"""The engine: ``EngineCore`` (schedule -> execute -> update), the loop that drives it in a
thread or a process of its own, and the ``EngineClient`` seam every front talks through."""
