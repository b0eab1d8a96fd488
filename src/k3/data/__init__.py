"""Data for pretraining: the embedded corpus, the byte-level BPE tokenizer, packed token datasets.

    files = prepare_data("runs/data")            # or `k3 tokenize --out runs/data`
    x, y = files.train.get_batch(step, batch_size, seq_len, seed)
    for x, y in files.val.iter_eval_batches(batch_size, seq_len): ...
"""
from k3.data.corpus import DEFAULT_VAL_FRACTION, Corpus, iter_documents, open_corpus, split_fraction
from k3.data.dataset import (
    DataFiles,
    PackedDataset,
    build_dataset,
    load_data,
    load_dataset,
    prepare_data,
    token_dtype,
)
from k3.data.tokenizer import (
    DEFAULT_TOKENIZER_MAX_BYTES,
    DEFAULT_VOCAB_SIZE,
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    Tokenizer,
    load_tokenizer,
    train_tokenizer,
)

__all__ = [
    "DEFAULT_TOKENIZER_MAX_BYTES", "DEFAULT_VAL_FRACTION", "DEFAULT_VOCAB_SIZE", "MIN_VOCAB_SIZE", "SPECIAL_TOKENS",
    "Corpus", "DataFiles", "PackedDataset", "Tokenizer", "build_dataset", "iter_documents", "load_data",
    "load_dataset", "load_tokenizer", "open_corpus", "prepare_data", "split_fraction", "token_dtype",
    "train_tokenizer",
]
