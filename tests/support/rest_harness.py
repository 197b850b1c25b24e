"""The REST shim in-process, on a ``ServerHarness``'s event loop: the gRPC server, the engine
and uvicorn share one loop thread, so tests can drive the shim over real HTTP and still use
``harness.assert_idle()`` (engine idle, every KV block free) afterwards."""

from __future__ import annotations

from server_harness import ServerHarness

from tokenwire.server.rest.app import RestSettings
from tokenwire.server.rest.server import RestServer
from tokenwire.server.rest.upstream import Upstream


class RestHarness:
    def __init__(
        self, harness: ServerHarness, target: str | None = None, **settings: object
    ) -> None:
        self.harness = harness
        self.target = target  # default: the harness's gRPC server
        self.settings = RestSettings(port=0, **settings)  # type: ignore[arg-type]
        self.server = RestServer(self.settings)
        self.upstream: Upstream | None = None

    def start(self) -> RestHarness:
        async def go() -> None:
            self.upstream = Upstream.connect(self.target or self.harness.target)
            await self.server.start(self.upstream)

        self.harness.run(go())
        return self

    def stop(self) -> None:
        async def go() -> None:
            await self.server.stop()
            if self.upstream is not None:
                await self.upstream.close()

        self.harness.run(go())

    @property
    def url(self) -> str:
        return self.server.url
