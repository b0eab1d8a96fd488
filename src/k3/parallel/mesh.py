"""Parallel dimensions and the process groups / DeviceMeshes built from them.

world = pp x dp. Inside each pipeline stage the dp ranks split the batch; the non-expert parameters are
sharded by FSDP2 over `fsdp` of them (replicated over dp / fsdp, i.e. HSDP, when fsdp < dp), and the routed
experts are sharded over `ep` of them (replicated over edp = dp / ep). Rank order: pp outermost, then
dp; inside dp, consecutive ranks form an EP group and an FSDP shard group (torchtitan's order).
"""
from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from k3.config import divisors

log = logging.getLogger(__name__)

__all__ = ["ParallelDims", "ParallelContext", "init_distributed", "build_context"]


@dataclass(frozen=True)
class ParallelDims:
    world: int
    ep: int = 1
    fsdp: int = 0  # 0: all dp ranks
    pp: int = 1

    def __post_init__(self):
        for name in ("world", "ep", "pp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} = {v!r} must be a positive integer")
        if self.fsdp < 0:
            raise ValueError(f"fsdp = {self.fsdp} must be >= 0 (0 = shard over all data-parallel ranks)")
        if self.world % self.pp:
            raise ValueError(f"world size {self.world} does not factor into the mesh: pp = {self.pp} does not divide "
                             f"it; use a world size that is a multiple of pp (e.g. {self.pp * max(1, self.world // self.pp)})")
        dp = self.world // self.pp
        if dp % self.ep:
            raise ValueError(f"world size {self.world} does not factor into the mesh: ep = {self.ep} does not divide "
                             f"the {dp} data-parallel ranks (world / pp); pick ep from {divisors(dp)}")
        if self.fsdp and dp % self.fsdp:
            raise ValueError(f"world size {self.world} does not factor into the mesh: fsdp = {self.fsdp} does not "
                             f"divide the {dp} data-parallel ranks (world / pp); pick fsdp from {divisors(dp)}")

    @property
    def dp(self) -> int:
        return self.world // self.pp

    @property
    def fsdp_size(self) -> int:
        return self.fsdp or self.dp

    @property
    def edp(self) -> int:
        """Copies of each expert shard (expert data parallelism)."""
        return self.dp // self.ep

    def describe(self) -> str:
        return f"world {self.world} = pp {self.pp} x dp {self.dp}; dp: fsdp {self.fsdp_size} x replicate " \
               f"{self.dp // self.fsdp_size}, ep {self.ep} x edp {self.edp}"



@dataclass
class ParallelContext:
    dims: ParallelDims
    rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    dp_group: object  # the dp ranks of this stage (batch split, loss mean)
    ep_group: object  # ranks sharing one copy of the experts
    edp_group: object  # ranks holding the same expert shard
    pp_group: object  # this rank's pipeline (one rank per stage)
    ep_mesh: object  # DeviceMesh ("edp", "ep") of this stage
    fsdp_mesh: object  # DeviceMesh ("fsdp",) or ("replicate", "fsdp") of this stage
    device: torch.device

    @property
    def pp_ranks(self) -> list[int]:
        return [s * self.dims.dp + self.dp_rank for s in range(self.dims.pp)]


def init_distributed(backend: str | None = None, timeout_s: float = 300.0, init_method: str | None = None,
                     rank: int | None = None, world_size: int | None = None) -> None:
    """init_process_group with a timeout (a dead peer fails the job instead of hanging it).
    Reads RANK / WORLD_SIZE / MASTER_ADDR from the environment (torchrun) unless given."""
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    kw = {}
    if init_method is not None:
        kw.update(init_method=init_method, rank=rank, world_size=world_size)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))


def build_context(dims: ParallelDims) -> ParallelContext:
    """Groups and meshes for `dims`; every rank must call it (new_group is collective)."""
    from torch.distributed.device_mesh import DeviceMesh

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world != dims.world:
        raise ValueError(f"the job has {world} ranks but the mesh asks for {dims.world}; launch with "
                         f"--nproc {dims.world} or change --ep/--fsdp/--pp")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    dp, ep, pp = dims.dp, dims.ep, dims.pp
    pp_rank, dp_rank = divmod(rank, dp)
    grid = torch.arange(world).view(pp, dp)
    groups = {}
    # new_group must be entered by every rank in the same order, for every group, even ones it is not in
    for kind, rows in (
        ("dp", [grid[s].tolist() for s in range(pp)]),
        ("ep", [grid[s, i * ep:(i + 1) * ep].tolist() for s in range(pp) for i in range(dp // ep)]),
        ("edp", [grid[s, j::ep].tolist() for s in range(pp) for j in range(ep)]),
        ("pp", [grid[:, i].tolist() for i in range(dp)]),
    ):
        for ranks in rows:
            g = dist.new_group(ranks)
            if rank in ranks:
                groups[kind] = g
    # one world-wide DeviceMesh per factorisation of dp, built by every rank alike, then sliced to this stage
    dt, f = device.type, dims.fsdp_size
    ep_world = DeviceMesh(dt, grid.view(pp, dp // ep, ep), mesh_dim_names=("pp", "edp", "ep"))
    ep_mesh = ep_world["edp", "ep"]
    fsdp_world = DeviceMesh(dt, grid.view(pp, dp // f, f), mesh_dim_names=("pp", "replicate", "fsdp"))
    fsdp_mesh = fsdp_world["fsdp"] if f == dp else fsdp_world["replicate", "fsdp"]
    ctx = ParallelContext(dims, rank, pp_rank, dp_rank, dp_rank % ep, groups["dp"], groups["ep"], groups["edp"],
                          groups["pp"], ep_mesh, fsdp_mesh, device)
    log.info("rank %d: %s", rank, dims.describe())
    return ctx
