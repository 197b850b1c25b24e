"""``ParallelConfig``: tensor and data parallelism and the ranks' rendezvous (frozen, validated
like every section of ``config.EngineConfig``, which re-exports it)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenwire.runtime.config_checks import positive


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: ``tensor_parallel_size`` ranks, one process and device each, in
    one torch.distributed group, on ``nnodes`` nodes with the same number of ranks each.

    Rendezvous: ``distributed_init_method`` (``tcp://host:port`` or ``env://``, as torchrun
    sets MASTER_ADDR / MASTER_PORT) when given; else ``tcp://master_addr:master_port`` when
    there are several nodes; else a free loopback port. ``distributed_timeout`` bounds how long
    a collective waits on a silent peer (a dead or hung rank ends the engine within it);
    ``distributed_startup_timeout`` bounds the rendezvous and the model load.
    """

    tensor_parallel_size: int = 1
    # Data parallelism (docs/parallelism.md): this many engine cores behind one front, each
    # with the whole model (its own device on CUDA, its share of the cores on CPU).
    data_parallel_size: int = 1
    data_parallel_rank: int = 0  # set by the front for each core it starts; not a flag
    distributed_init_method: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    distributed_timeout: float = 10.0
    distributed_startup_timeout: float = 600.0

    def __post_init__(self) -> None:
        positive("tensor_parallel_size", self.tensor_parallel_size)
        positive("data_parallel_size", self.data_parallel_size)
        positive("nnodes", self.nnodes)
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank must be in [0, {self.data_parallel_size}), "
                f"got {self.data_parallel_rank}"
            )
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size ({self.tensor_parallel_size}) must be a multiple of "
                f"nnodes ({self.nnodes}): every node runs the same number of ranks"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a TCP port, got {self.master_port}")
        if self.distributed_timeout <= 0 or self.distributed_startup_timeout <= 0:
            raise ValueError("distributed_timeout and distributed_startup_timeout must be > 0")
        method = self.distributed_init_method
        if method is not None and not method.startswith(("tcp://", "env://")):
            raise ValueError(
                f"distributed_init_method must be tcp://HOST:PORT or env://, got {method!r}"
            )

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def cpu_ranks_per_node(self) -> int:
        """Processes that share this node's cores: every TP rank of every DP engine core."""
        return self.ranks_per_node * self.data_parallel_size
