"""Training: the loop (`Trainer`), optimizers (AdamW, Muon, QK-Clip), WSD schedule, checkpoints, metrics.

    from k3.train import Trainer, TrainConfig
    result = Trainer(config, TrainConfig(steps=100), files.train, files.val, out_dir="runs/train").fit()
"""
from k3.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from k3.train.optim import Muon, QKClip, build_optimizer, newton_schulz, split_params
from k3.train.schedule import WSDSchedule
from k3.train.trainer import TrainConfig, Trainer, TrainResult, evaluate, load_trained_model, train

__all__ = [
    "CheckpointError", "Muon", "QKClip", "TrainConfig", "TrainResult", "Trainer", "WSDSchedule", "build_optimizer",
    "evaluate", "latest_checkpoint", "load_checkpoint", "load_trained_model", "newton_schulz", "save_checkpoint",
    "split_params", "train",
]
