"""Data for training: corpus, tokenizer, packing into sequences, and the distributed sampler.

Typical use by the training loop::

    data = prepare_lm_data(args.data, args.tokenizer, seq_len=args.seq_len,
                           min_train_sequences=args.global_batch)
    sampler = DistributedSampler(len(data.train), args.global_batch, dp_size, dp_rank, args.seed)
    for mb in microbatches(data.train, sampler.next_local_batch(), args.micro_batch):
        loss = model(mb["input_ids"], mb["labels"])
"""

from shardwise.data.corpus import (
    corpus_fingerprint,
    default_cache_dir,
    load_documents,
    source_files,
    stdlib_corpus_files,
)
from shardwise.data.dataset import TokenData, prepare_lm_data
from shardwise.data.sampler import DistributedSampler, microbatches
from shardwise.data.tokenizer import (
    EOS_TOKEN,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)

__all__ = [
    "EOS_TOKEN",
    "ByteTokenizer",
    "DistributedSampler",
    "HFTokenizer",
    "TokenData",
    "Tokenizer",
    "corpus_fingerprint",
    "default_cache_dir",
    "load_documents",
    "load_tokenizer",
    "microbatches",
    "prepare_lm_data",
    "source_files",
    "stdlib_corpus_files",
]
