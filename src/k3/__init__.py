"""k3: Kimi K3 in PyTorch. `k3.load(path)` reads any checkpoint k3 knows (k3.io)."""


def load(path, dtype=None, device="cpu", experts="resident", ram_budget=None, prefetch=True, trunk=None):
    """K3Model (eval mode) from a k3 checkpoint or export, or a released Kimi-Linear / Kimi K3 folder (k3.io);
    `experts="stream", ram_budget="8GB"` reads a released folder's MXFP4 routed experts from disk as used, and
    `trunk="fp8"` then keeps the rest's matrices in fp8."""
    from k3.io import load as _load

    return _load(path, dtype=dtype, device=device, experts=experts, ram_budget=ram_budget, prefetch=prefetch,
                 trunk=trunk)
