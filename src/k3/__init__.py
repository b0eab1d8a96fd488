"""k3: Kimi K3 in PyTorch. `k3.load(path)` reads any checkpoint k3 knows (k3.io)."""


def load(path, dtype=None, device="cpu"):
    """K3Model (eval mode) from a k3 checkpoint or export, or a released Kimi-Linear / Kimi K3 folder (k3.io)."""
    from k3.io import load as _load

    return _load(path, dtype=dtype, device=device)
