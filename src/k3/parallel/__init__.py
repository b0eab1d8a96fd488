"""k3.parallel: distributed training on torch.distributed, applied to the model from outside.

    comm        the one instrumented door to collectives (bytes per tag)
    placement   expert placement: contiguous shards, or EPLB-style balanced with replicas
    expert      MoonEP: ExpertParallel (all-to-all of the latent payload), gradient sync, gathering
    mesh        ParallelDims (world = pp x dp; fsdp, ep inside dp) -> process groups and DeviceMeshes
    fsdp        FSDP2 for the non-expert weights, collectives counted
    train       DistributedContext: the one loop (k3.train.loop) over ranks; ParallelTrainer: Trainer in it
    checkpoint  torch.distributed.checkpoint save/load that reshards to any rank count
    pipeline    pipeline stages over send/recv that carry the AttnRes sources
    launch      local gloo jobs (tests, benchmarks) and the torchrun re-launch of `k3 train`
See docs/distributed.md.
"""
