"""The engine, split by side of the front <-> core seam.

Front side (the server's or ``LLM``'s process): ``protocol`` (the ``EngineClient`` seam,
``EngineInfo``), ``async_engine`` (``AsyncEngine``, on ``async_engine_outputs`` on
``async_engine_base``), ``request_stream``, ``core_client`` with ``inproc_client`` and the
client half of ``core_process`` (``MPCoreClient``).
Core side (the engine-core process): ``core`` (``EngineCore.step()`` = schedule -> execute ->
update), ``core_loop`` (the busy loop over input records), the process half of
``core_process``, and ``fault`` (test-only fault injection).
Both: ``messages``, the plain records that cross between them.
"""
