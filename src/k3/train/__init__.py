"""Training: the one loop (`Loop`; `Trainer` for pretraining), optimizers (AdamW, Muon, QK-Clip), WSD schedule,
checkpoints, metrics.

    from k3.train import Trainer, TrainConfig
    result = Trainer(config, TrainConfig(steps=100), files.train, files.val, out_dir="runs/train").fit()
"""
from k3.train.batches import evaluate
from k3.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from k3.train.config import TrainConfig
from k3.train.loop import LocalContext, Loop, TrainResult
from k3.train.optim import Muon, QKClip, build_optimizer, newton_schulz, split_params
from k3.train.schedule import WSDSchedule
from k3.train.trainer import Trainer, train

__all__ = [
    "CheckpointError", "LocalContext", "Loop", "Muon", "QKClip", "TrainConfig", "TrainResult", "Trainer",
    "WSDSchedule", "build_optimizer", "evaluate", "latest_checkpoint", "load_checkpoint", "newton_schulz",
    "save_checkpoint", "split_params", "train",
]
