"""Batches for the loop: what a dataset must give, checks before training, and validation windows."""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

from k3.config import K3Config
from k3.train.device import autocast


def split_batch(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A dataset batch -> (inputs [B, T], targets [B, T]): accepts (x, y), (x, y, doc_ids), {"input_ids",
    "labels"} or [B, T+1]."""
    if isinstance(batch, dict):
        return batch["input_ids"], batch.get("labels", batch.get("targets"))
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3):
        return batch[0], batch[1]
    if isinstance(batch, torch.Tensor) and batch.dim() == 2:
        return batch[:, :-1], batch[:, 1:]
    raise ValueError(f"dataset returned a batch of type {type(batch).__name__}; expected (inputs, targets)")


def dataset_vocab_size(dataset) -> int | None:
    v = getattr(dataset, "vocab_size", None)
    if v is None:
        v = getattr(dataset, "manifest", {}).get("vocab_size")
    return v


def check_dataset(dataset, name: str, config: K3Config, batch_size: int, seq_len: int, seed: int,
                  min_tokens: int | None = None) -> None:
    """Fail before training on a dataset that cannot produce one batch or whose ids exceed the vocab."""
    if dataset is None or not hasattr(dataset, "get_batch"):
        raise ValueError(f"{name} dataset {dataset!r} has no get_batch(step, batch_size, seq_len, seed)")
    vocab = dataset_vocab_size(dataset)
    if vocab is not None and vocab != config.vocab_size:
        raise ValueError(f"{name} data was tokenized with a vocabulary of {vocab} tokens but the model has "
                         f"vocab_size = {config.vocab_size}; use --set vocab_size={vocab} or retokenize with "
                         f"--vocab-size {config.vocab_size}")
    n_tokens = _n_tokens(dataset)
    need = min_tokens if min_tokens is not None else seq_len + 1
    if n_tokens is not None and n_tokens < need:
        if min_tokens is None:
            more = ("more text, a larger share of it for validation (`k3 tokenize --val-fraction`)"
                    if name == "validation" else "more text")
            raise ValueError(f"{name} data has {n_tokens:,} tokens, fewer than one window needs ({need:,} = seq_len "
                             f"+ 1); give {more}, or lower --seq-len")
        raise ValueError(f"{name} data has {n_tokens:,} tokens, fewer than one batch needs ({need:,} = "
                         f"batch_size x seq_len + 1); give more text or lower --batch-size / --seq-len")
    x, y = split_batch(dataset.get_batch(0, batch_size, seq_len, seed))
    if tuple(x.shape) != (batch_size, seq_len) or tuple(y.shape) != (batch_size, seq_len):
        raise ValueError(f"{name} data returned batches of shape {tuple(x.shape)}/{tuple(y.shape)}, expected "
                         f"({batch_size}, {seq_len})")
    top = int(max(x.max(), y.max()))
    if top >= config.vocab_size or int(min(x.min(), y.min())) < 0:
        raise ValueError(f"{name} data holds token id {top} but the model's vocab_size is {config.vocab_size}; "
                         "the data and the model use different tokenizers")


def _n_tokens(dataset) -> int | None:
    for attr in ("n_tokens", "num_tokens"):
        v = getattr(dataset, attr, None)
        if isinstance(v, int):
            return v
    try:
        return len(dataset)
    except TypeError:
        return None


def has_documents(dataset) -> bool:
    """Whether `dataset` knows where its packed documents start (`get_batch(..., docs=True)` gives their ids)."""
    return callable(getattr(dataset, "window_doc_ids", None))


def eval_batches(dataset, batch_size: int, seq_len: int, max_batches: int | None = None, seed: int = 0,
                 docs: bool = False):
    """Validation batches of non-overlapping windows [B, T] -> (inputs, targets).

    All of the split in order (`max_batches` None), or `max_batches` batches of windows spread evenly over
    the whole split, so a capped evaluation is not just the split's first document(s). Datasets without a
    flat `tokens` array fall back to `iter_eval_batches` or to get_batch(i, ...) for i < max_batches. `docs`
    (a dataset with `has_documents`): also each input token's document id, as a third element.
    """
    tokens = getattr(dataset, "tokens", None)
    if tokens is not None and hasattr(tokens, "__len__") and len(tokens) > seq_len:
        n_windows = (len(tokens) - 1) // seq_len
        if max_batches is None or max_batches * batch_size >= n_windows:
            picks = np.arange(n_windows)
        else:
            picks = np.unique(np.linspace(0, n_windows - 1, max_batches * batch_size).round().astype(np.int64))
        for i in range(0, len(picks), batch_size):
            w = np.stack([np.asarray(tokens[s * seq_len:s * seq_len + seq_len + 1], dtype=np.int64)
                          for s in picks[i:i + batch_size]])
            x, y = torch.from_numpy(w[:, :-1].copy()), torch.from_numpy(w[:, 1:].copy())
            yield (x, y, dataset.window_doc_ids(picks[i:i + batch_size] * seq_len, seq_len)) if docs else (x, y)
        return
    if hasattr(dataset, "iter_eval_batches"):
        yield from dataset.iter_eval_batches(batch_size, seq_len, max_batches, **({"docs": True} if docs else {}))
        return
    if max_batches is None:
        raise ValueError("eval_batches: this dataset has no tokens array or iter_eval_batches; give max_batches")
    for i in range(max_batches):
        batch = dataset.get_batch(i, batch_size, seq_len, seed, **({"docs": True} if docs else {}))
        yield batch if docs else split_batch(batch)


def eval_batch_count(dataset, batch_size: int, seq_len: int, max_batches: int | None = None) -> int | None:
    """How many batches `eval_batches` yields for these arguments (None where the dataset cannot say)."""
    tokens = getattr(dataset, "tokens", None)
    if tokens is not None and hasattr(tokens, "__len__") and len(tokens) > seq_len:
        n_windows = (len(tokens) - 1) // seq_len
        if max_batches is not None and max_batches * batch_size < n_windows:
            n_windows = len(np.unique(np.linspace(0, n_windows - 1, max_batches * batch_size).round()))
        return -(-n_windows // batch_size)
    return max_batches


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset, batches: int | None, batch_size: int, seq_len: int, seed: int = 0,
             device: torch.device | str = "cpu", progress: Callable[[int], None] | None = None,
             doc_mask: bool = False, precision: str = "fp32") -> float:
    """Mean cross-entropy (nats / token) over `batches` validation batches spread evenly over the split (None:
    all of them; see `eval_batches`). `progress(1)` is called after each batch. `doc_mask` (a dataset with
    `has_documents`): each packed document is read on its own, as a prompt is served. `precision`: fp32 or bf16
    (autocast; resolve auto first, k3.train.precision)."""
    docs = doc_mask and has_documents(dataset)
    device = torch.device(device)
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    try:
        for batch in eval_batches(dataset, batch_size, seq_len, batches, seed, docs=docs):
            x, y = batch[0].to(device), batch[1].to(device)
            with autocast(device, precision):
                logits = model(x) if not docs else model(x, doc_ids=batch[2].to(device))
            total += float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1),
                                           reduction="sum"))
            n += y.numel()
            if progress is not None:
                progress(1)
    finally:
        model.train(was_training)
    if n == 0:
        raise ValueError("evaluation saw no tokens; the validation split is smaller than one sequence")
    return total / n
